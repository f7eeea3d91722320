//! `tollgate_jobs_total{route,result}` (jobs ended: done|failed|expired|cancelled) and
//! `tollgate_jobs{route,state}` (this instance's jobs: queued|running).

use std::sync::OnceLock;

use prometheus::{register_int_counter_vec, register_int_gauge_vec, IntGauge, IntGaugeVec};

use crate::route::Router;

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
        for result in ["done", "failed", "expired", "cancelled"] {
            m.total.with_label_values(&[&*r.label, result]);
        }
        for state in ["queued", "running"] {
            m.jobs.with_label_values(&[&*r.label, state]);
        }
    }
}

pub(super) fn ended(route: &str, result: &str) {
    get().total.with_label_values(&[route, result]).inc();
}

/// Counts a job in `tollgate_jobs{route,state}` while it is in that state.
pub(super) struct InState(IntGauge);

impl InState {
    pub(super) fn new(route: &str, state: &str) -> InState {
        let g = get().jobs.with_label_values(&[route, state]);
        g.inc();
        InState(g)
    }
}

impl Drop for InState {
    fn drop(&mut self) {
        self.0.dec();
    }
}
