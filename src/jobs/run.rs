//! A job's life: charged before its body is read (`charge`), queued once it is ([`submit`]);
//! then its own task waits for the route's slot (or a `DELETE`, or `result_ttl`), sends the
//! request, keeps the answer, and settles the charge the way a synchronous request's is
//! settled (DESIGN §3, §6, §8).

use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::metrics::{self, InState, JobResult, JobState};
use super::send::{self, JobRequest, Sent};
use super::{board, new_id, Job, NewJob, Status, Stored};
use crate::admission::{InFlight, Ticket};
use crate::problem::{self, Problem};
use crate::route::stated::Report;
use crate::route::{AsyncRules, Route};
use crate::state::{Running, Shared};
use crate::store::memory::{JobPlace, MemoryStore};
use crate::store::{Admission, Standing};
use crate::telemetry::access;

/// A job accepted: charged, queued, its task started.
pub struct Submission {
    pub id: Arc<str>,
    pub standing: Standing,
    /// Its place in the route's fair order (1: next); 0 when a slot was free.
    pub position: usize,
    /// `max_delay`: how long from now before its reserved units are due (it runs no sooner).
    pub hold: Duration,
}

/// What the end-of-job access-log line says about the request (never the key).
#[derive(Debug, Clone)]
pub struct Origin {
    pub method: String,
    pub key: String,
    pub request_id: Option<String>,
    pub client: Option<IpAddr>,
}

struct Task {
    shared: Arc<Shared>,
    running: Arc<Running>,
    route: Arc<Route>,
    rules: AsyncRules,
    job: Arc<Job>,
    /// Its charge and, once granted, its slot.
    ticket: Ticket,
    place: Option<JobPlace>,
    cancelled: oneshot::Receiver<()>,
    request: JobRequest,
    origin: Origin,
    submitted: Instant,
}

/// Queues a job charged in this process's store (`ticket`; `delay`: `max_delay`'s) and starts
/// its task; `Err` is the refusal of this process's bound on held bytes or of the route's
/// full queue, the charge given back (no job).
pub(super) async fn submit(
    shared: &Arc<Shared>,
    m: &Arc<MemoryStore>,
    new: NewJob<'_>,
    mut ticket: Ticket,
    delay: Duration,
) -> Result<Submission, Admission> {
    let bytes = new.request.body.len() as u64;
    // This process holds as much for jobs as it may, or the route's queue is full: refused.
    let reserved = board().reserve(bytes);
    let due = Instant::now() + delay;
    let place = match reserved {
        true => m.queue_job(&ticket.req, new.cap, due),
        false => None,
    };
    let Some(place) = place else {
        if reserved {
            board().unreserve(bytes);
        }
        let standing = ticket.refund(&shared.store).await;
        return Err(Admission::RouteBusy {
            standing,
            queued: Duration::ZERO,
            full: true,
        });
    };
    let waiting = match &place {
        JobPlace::Slot(_) => None,
        JobPlace::Waiting(w) => Some(w.place()),
    };
    let position = waiting.as_ref().and_then(|p| p.position()).unwrap_or(0);
    let (tx, rx) = oneshot::channel();
    let job = Arc::new(Job {
        id: new_id(),
        key: new.who.hash,
        route: new.route.label.clone(),
        status: Mutex::new(Status::Queued(waiting)),
        cancel: Mutex::new(Some(tx)),
        refunded: tokio::sync::Notify::new(),
        bytes: AtomicU64::new(bytes),
        due,
    });
    board().insert(job.clone());
    let standing = ticket.outcome;
    tokio::spawn(run(Task {
        shared: shared.clone(),
        running: new.running,
        route: new.route,
        rules: new.rules,
        job: job.clone(),
        ticket,
        place: Some(place),
        cancelled: rx,
        request: new.request,
        origin: new.origin,
        submitted: Instant::now(),
    }));
    Ok(Submission {
        id: job.id.clone(),
        standing,
        position,
        hold: delay,
    })
}

/// The result of a job that found no slot within `result_ttl`: a 503 `route-busy` with
/// `Retry-After: 1`, as a synchronous request's (DESIGN §3).
pub(super) fn expired_result() -> Stored {
    let detail = "the job found no free slot within async.result_ttl; its charge was refunded";
    let mut r = problem_result(Problem::RouteBusy, detail);
    // `Retry-After` and its member agree, as in the gateway's other answers.
    r.body = problem::body(Problem::RouteBusy, detail, None, None, Some(1)).into();
    r.headers.push((
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    ));
    r
}

/// The gateway's own answer as a job's result.
pub(super) fn problem_result(p: Problem, detail: &str) -> Stored {
    Stored {
        status: p.status(),
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/problem+json"),
        )],
        body: problem::body(p, detail, None, None, None).into(),
    }
}

/// How a job ended, for its metrics and its last access-log line.
struct Ended {
    result: JobResult,
    status: u16,
    upstream_status: Option<u16>,
    cost: u64,
    queued: Duration,
    /// Its `max_delay` hold, in the queue without a slot, until its reserved units were due.
    hold: Duration,
    upstream: Option<Duration>,
    /// Bytes of the result kept.
    kept: u64,
}

async fn run(mut t: Task) {
    let waited = Instant::now();
    let queued_gauge = InState::new(&t.route.label, JobState::Queued);
    // The exit waits for a queued job to say it was not run (`app::give_back_held`).
    let waiting = t.shared.drain.waiting();
    let mut exiting = false;
    let slot = match t.place.take() {
        Some(JobPlace::Slot(s)) => Some(s),
        Some(JobPlace::Waiting(w)) => tokio::select! {
            s = w.granted() => Some(s),
            _ = &mut t.cancelled => None,
            // `result_ttl` from when it may run (a `max_delay` hold first).
            _ = tokio::time::sleep_until((t.job.due + t.rules.result_ttl).into()) => None,
            _ = t.shared.drain.grace_over() => {
                exiting = true;
                None
            }
        },
        None => None,
    };
    drop(queued_gauge);
    // Waiting for its units (`max_delay`: the queue serves it no sooner) is its hold; the
    // rest of its wait, its queue time.
    let total = waited.elapsed();
    let held = t.job.due.saturating_duration_since(waited).min(total);
    let queued = total - held;
    // A draining instance starts no job: on the memory store its queue ends with it (each
    // job still queued as it exits says so).
    let draining = exiting || t.shared.drain.is_draining();
    let slot = match slot {
        Some(slot) if !draining && t.job.start() => slot,
        _ if draining => {
            tracing::warn!(job = %t.job.id, route = %t.route.label, "queued job not run: the instance is shutting down");
            return;
        }
        slot => {
            // Cancelled, or no slot within result_ttl: it never ran, so its charge goes back.
            drop(slot);
            t.ticket.refund(&t.shared.store).await;
            t.job.refunded.notify_waiters();
            let result = if t.job.expire(t.rules.result_ttl) {
                board().resize(&t.job, 0);
                JobResult::Expired
            } else {
                board().remove(&t.job.id);
                JobResult::Cancelled
            };
            // Expired: the 503 its polls get; cancelled: nobody is answered (its client
            // called it off), 499 as for a client that left.
            let status = if result == JobResult::Expired {
                503
            } else {
                499
            };
            return t.ended(Ended {
                result,
                status,
                upstream_status: None,
                cost: 0,
                queued,
                hold: held,
                upstream: None,
                kept: 0,
            });
        }
    };
    drop(waiting);
    t.ticket.attach_route(slot);
    let ended = execute(&mut t, queued, held).await;
    // From now on the job holds its result, not its request.
    board().resize(&t.job, ended.kept);
    t.ended(ended);
}

/// Runs a job that holds its slot, and keeps its result.
async fn execute(t: &mut Task, queued: Duration, held: Duration) -> Ended {
    // SIGTERM lets a running job finish within grace_period, like a request.
    let _drain = t.shared.drain.enter();
    let _running = InState::new(&t.route.label, JobState::Running);
    let (running, route) = (t.running.clone(), t.route.clone());
    let rm = running.metrics.get(&route);
    let _in_flight = InFlight::new(&rm.in_flight);
    // `max_delay`: the queue serves it no sooner than its reserved units are due, so this is
    // nothing but a clock's rounding; it is waited out all the same (it is sent no sooner).
    let rounding = t.job.due.saturating_duration_since(Instant::now());
    if !rounding.is_zero() {
        tokio::time::sleep(rounding).await;
    }
    let started = Instant::now();
    let sent = send::send(
        &t.running,
        t.shared.tracing.as_ref(),
        &t.route,
        &t.job.id,
        &t.request,
        t.rules.max_response_body,
        queued,
    )
    .await;
    let mut ended = Ended {
        result: JobResult::Failed,
        status: 502,
        upstream_status: None,
        cost: t.ticket.req.cost,
        queued,
        hold: held + rounding,
        upstream: None,
        kept: 0,
    };
    let result = match sent {
        Sent::Answer {
            stored,
            upstream,
            report,
        } => {
            ended.cost = settle(t, upstream, report).await;
            ended.result = JobResult::Done;
            ended.status = stored.status;
            ended.upstream_status = Some(stored.status);
            ended.upstream = Some(upstream);
            stored
        }
        Sent::Unreachable(detail) => {
            t.ticket.refund(&t.shared.store).await;
            ended.cost = 0;
            tracing::warn!(job = %t.job.id, route = %t.route.label, error = %detail, "job's upstream unreachable; refunded");
            problem_result(
                Problem::BadGateway,
                "the upstream could not be reached; the job's charge was refunded",
            )
        }
        Sent::TimedOut(follow) => {
            ended.status = 504;
            // Its end line's upstream time is a synchronous 504's: until the timeout.
            let upstream = started.elapsed();
            ended.upstream = Some(upstream);
            let detail = "the upstream did not answer within read_timeout; it had the request, so the charge stands";
            ended.kept = t.job.finish(
                problem_result(Problem::GatewayTimeout, detail),
                t.rules.result_ttl,
            );
            // The slot follows the upstream's late answer, as for a synchronous request; a
            // `cost_per_second` route bills the time the upstream worked.
            // (Its upstream time is observed as it is billed: to the late answer's head.)
            let told = follow.until_done(&t.route, started, upstream).await;
            rm.upstream_duration.observe(told.upstream.as_secs_f64());
            ended.cost = settle(t, told.upstream, told.report).await;
            return ended;
        }
        Sent::TooLarge { upstream } => {
            ended.cost = settle(t, upstream, None).await;
            ended.upstream = Some(upstream);
            problem_result(Problem::JobResponseTooLarge, "the upstream's answer is larger than async.max_response_body; it did the work, so the charge stands")
        }
        Sent::Broken { upstream, detail } => {
            ended.cost = settle(t, upstream, None).await;
            ended.upstream = Some(upstream);
            tracing::warn!(job = %t.job.id, route = %t.route.label, error = %detail, "job's upstream answer broke off");
            problem_result(Problem::BadGateway, super::send::BROKEN)
        }
    };
    ended.kept = t.job.finish(result, t.rules.result_ttl);
    if let Some(u) = ended.upstream {
        rm.upstream_duration.observe(u.as_secs_f64());
    }
    ended
}

/// Frees the slot and makes the job's charge final, as `cost_from_response` and
/// `cost_per_second` say; the final charge.
async fn settle(t: &mut Task, upstream: Duration, report: Option<Report>) -> u64 {
    let total = (t.route.fidelity).charge(t.ticket.req.cost, Some(upstream), report);
    t.ticket.release().await;
    t.ticket.settle(&t.shared.store, total).await;
    if let Some(r) = report {
        t.running.metrics.get(&t.route).cost_report(r);
    }
    total
}

impl Task {
    /// The job's last metrics and access-log line.
    fn ended(&self, e: Ended) {
        metrics::ended(&self.route.label, e.result);
        let rm = self.running.metrics.get(&self.route);
        if e.cost > 0 {
            rm.cost_units.inc_by(e.cost);
        }
        if !access::enabled() {
            return;
        }
        let trace =
            super::send::trace_of(self.shared.tracing.is_some(), &self.request.header.headers);
        access::write(&access::AccessRecord {
            method: &self.origin.method,
            route: &self.route.label,
            key: &self.origin.key,
            cost: e.cost,
            decision: e.result.verdict(),
            status: e.status,
            latency_ms: access::millis(self.submitted.elapsed()),
            upstream_ms: e.upstream.map(access::millis),
            store_ms: 0.0,
            queue_ms: access::millis(e.queued),
            hold_ms: access::millis(e.hold),
            upstream_status: e.upstream_status,
            request_id: self.origin.request_id.as_deref(),
            trace_id: trace.as_ref().map(|t| t.as_str()),
            fallback: false,
            shadow: None,
            client: self.origin.client,
            error: None,
            job: Some(&self.job.id),
        });
    }
}
