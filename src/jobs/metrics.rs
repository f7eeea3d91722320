//! `tollgate_jobs_total{route,result}` (jobs ended: done|failed|expired|cancelled) and
//! `tollgate_jobs{route,state}` (this instance's jobs: queued|running).

use std::sync::OnceLock;

use prometheus::{register_int_counter_vec, register_int_gauge_vec, IntGauge, IntGaugeVec};

use crate::decision::Verdict;
use crate::route::Router;

/// How a job ended: the `result` label of `tollgate_jobs_total` (and, for a fleet job, the
/// state its record ends in: `done` or `failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobResult {
    Done,
    Failed,
    Expired,
    Cancelled,
}

impl JobResult {
    pub const ALL: [JobResult; 4] = [
        JobResult::Done,
        JobResult::Failed,
        JobResult::Expired,
        JobResult::Cancelled,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            JobResult::Done => "done",
            JobResult::Failed => "failed",
            JobResult::Expired => "expired",
            JobResult::Cancelled => "cancelled",
        }
    }

    /// The `decision` of the job's last access-log line.
    pub const fn verdict(self) -> Verdict {
        match self {
            JobResult::Done => Verdict::JobDone,
            JobResult::Failed => Verdict::JobFailed,
            JobResult::Expired => Verdict::JobExpired,
            JobResult::Cancelled => Verdict::JobCancelled,
        }
    }
}

/// Where a job of this instance is: the `state` label of `tollgate_jobs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Queued,
    Running,
}

impl JobState {
    pub const ALL: [JobState; 2] = [JobState::Queued, JobState::Running];

    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
        }
    }
}

struct JobMetrics {
    total: prometheus::IntCounterVec,
    jobs: IntGaugeVec,
}

/// Registration only fails on a name clash, which is a bug caught by any test.
#[allow(clippy::expect_used)]
fn get() -> &'static JobMetrics {
    static M: OnceLock<JobMetrics> = OnceLock::new();
    M.get_or_init(|| JobMetrics {
        total: register_int_counter_vec!(
            "tollgate_jobs_total",
            "Async jobs ended, by route and result: done|failed|expired|cancelled",
            &["route", "result"]
        )
        .expect("register"),
        jobs: register_int_gauge_vec!(
            "tollgate_jobs",
            "This instance's async jobs, by route and state: queued|running",
            &["route", "state"]
        )
        .expect("register"),
    })
}

/// Every async route's series from the start, so that dashboards see zeros.
pub fn announce(router: &Router) {
    let m = get();
    for r in router.routes().filter(|r| r.jobs.is_some()) {
        for result in JobResult::ALL {
            m.total.with_label_values(&[&*r.label, result.as_str()]);
        }
        for state in JobState::ALL {
            m.jobs.with_label_values(&[&*r.label, state.as_str()]);
        }
    }
}

/// On Redis: the route's queued jobs fleet-wide, as this instance's last beat for the fleet
/// saw them (a queued job belongs to no instance; every instance shows the same figure).
pub(super) fn fleet_queued(route: &str, queued: u64) {
    get()
        .jobs
        .with_label_values(&[route, JobState::Queued.as_str()])
        .set(i64::try_from(queued).unwrap_or(i64::MAX));
}

/// `tollgate_jobs{route,state}` now: (queued, running).
pub fn counts(route: &str) -> (usize, usize) {
    let m = get();
    let of = |s: JobState| m.jobs.with_label_values(&[route, s.as_str()]).get().max(0) as usize;
    (of(JobState::Queued), of(JobState::Running))
}

pub(super) fn ended(route: &str, result: JobResult) {
    get()
        .total
        .with_label_values(&[route, result.as_str()])
        .inc();
}

/// Counts a job in `tollgate_jobs{route,state}` while it is in that state.
pub(super) struct InState(IntGauge);

impl InState {
    pub(super) fn new(route: &str, state: JobState) -> InState {
        let g = get().jobs.with_label_values(&[route, state.as_str()]);
        g.inc();
        InState(g)
    }
}

impl Drop for InState {
    fn drop(&mut self) {
        self.0.dec();
    }
}
