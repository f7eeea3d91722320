//! Each route's series, resolved once per config instead of by label lookup per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

use super::metrics;
use super::recent::{self, Counts, LastMinute};
use crate::reason::Reason;
use crate::route::stated::{self, Report};
use crate::route::{Route, Router};

/// Statuses whose `tollgate_requests_total` series a route keeps a handle to.
const COMMON_STATUSES: [u16; 16] = [
    200, 201, 202, 204, 301, 302, 304, 400, 401, 403, 404, 429, 500, 502, 503, 504,
];

/// Statuses whose series every route has from the start (see [`RouteMetrics::announce`]).
const ANNOUNCED_STATUSES: [u16; 6] = [200, 429, 500, 502, 503, 504];

/// One route's series, resolved once when a running gateway installs a config (and again, to
/// the same series, on reload) instead of by label lookup on every request.
pub struct RouteMetrics {
    label: Arc<str>,
    pub request_duration: Lazy<Histogram>,
    pub upstream_duration: Lazy<Histogram>,
    pub queue_wait: Lazy<Histogram>,
    pub in_flight: Lazy<IntGauge>,
    pub cost_units: Lazy<IntCounter>,
    pub overhead: Lazy<Histogram>,
    pub admitted_duration: Lazy<Histogram>,
    /// `cost_from_response`: the costs the upstream stated and the charges settled on them
    /// (for the audit's mean stated cost), beside `tollgate_cost_reports_total`.
    pub stated: StatedCosts,
    /// `tollgate_requests_total{route, status}` for the common statuses, made on first use so
    /// that no zero series appear for statuses a route never answers.
    statuses: [OnceLock<IntCounter>; COMMON_STATUSES.len()],
    /// Admitted and refused requests of the last minute (`/admin/routes`); made with the
    /// route's first counted request, so routes without traffic cost one pointer.
    recent: OnceLock<Box<LastMinute>>,
    /// `tollgate_in_flight_limit`: the route's `max_in_flight` in the config in force, and
    /// whether its series is out (from the start for announced routes, else from the route's
    /// first counted request). One lock, taken at a route's first request and on reloads, so
    /// that a reload during the first request cannot leave the old cap out.
    limit: Mutex<Limit>,
}

/// How many routes (in the order of their patterns: `endpoints` is a sorted map) have their
/// series from the start; the others get theirs with their first request, so that `/metrics`
/// stays small with thousands of endpoints.
pub const ANNOUNCED_ROUTES: usize = 200;

/// A route's series of one metric, registered on first use.
pub struct Lazy<T> {
    cell: OnceLock<T>,
    label: Arc<str>,
    make: fn(&crate::telemetry::Metrics, &[&str]) -> T,
}

impl<T> Lazy<T> {
    fn new(label: &Arc<str>, make: fn(&crate::telemetry::Metrics, &[&str]) -> T) -> Lazy<T> {
        Lazy {
            cell: OnceLock::new(),
            label: label.clone(),
            make,
        }
    }
}

impl<T> std::ops::Deref for Lazy<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.cell
            .get_or_init(|| (self.make)(metrics(), &[&*self.label]))
    }
}

impl std::fmt::Debug for RouteMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteMetrics")
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// How many [`RouteMetrics`] of each label are alive (in the config in force, or in an older
/// one its requests still run under), and the labels none is alive of any more, whose series
/// [`retire_pending`] removes: a route a reload removed keeps its series while its requests
/// finish (their counts would go to series no longer exported), and a route added back meanwhile
/// carries on with them.
#[derive(Default)]
struct Alive {
    count: std::collections::HashMap<Arc<str>, usize>,
    gone: Vec<Arc<str>>,
}

fn alive() -> std::sync::MutexGuard<'static, Alive> {
    static ALIVE: OnceLock<Mutex<Alive>> = OnceLock::new();
    crate::store::lock(ALIVE.get_or_init(Mutex::default))
}

impl Drop for RouteMetrics {
    fn drop(&mut self) {
        let mut a = alive();
        if let Some(n) = a.count.get_mut(&self.label) {
            *n -= 1;
            if *n == 0 {
                a.count.remove(&self.label);
                a.gone.push(self.label.clone());
            }
        }
    }
}

/// Removes the series of the routes no config in use has any more (a reload removed them and
/// their last request has ended): after a reload, and before each scrape of `/metrics` — off
/// the request path (the last request of such a route only notes its label).
pub fn retire_pending() {
    // Held throughout: a reload that adds a label back meanwhile waits, so that its new
    // handles are never made of series about to be removed.
    let mut a = alive();
    let gone = std::mem::take(&mut a.gone);
    if gone.is_empty() {
        return;
    }
    let m = metrics();
    // Not those added back since.
    let gone: std::collections::HashSet<&str> = gone
        .iter()
        .map(|l| &**l)
        .filter(|l| !a.count.contains_key(*l))
        .collect();
    for &label in &gone {
        for vec in [
            &m.request_duration,
            &m.upstream_duration,
            &m.queue_wait,
            &m.overhead,
            &m.admitted_duration,
        ] {
            let _ = vec.remove_label_values(&[label]);
        }
        let _ = m.in_flight.remove_label_values(&[label]);
        let _ = m.cost_units.remove_label_values(&[label]);
        let _ = m.in_flight_limit.remove_label_values(&[label]);
        let _ = m.queued.remove_label_values(&[label]);
    }
    // One pass over each `{route, …}` counter for every route retired.
    for vec in [
        &m.requests,
        &m.rejections,
        &m.shadow_rejections,
        &m.cost_reports,
    ] {
        remove_route_series(vec, &gone);
    }
}

impl RouteMetrics {
    fn new(label: &Arc<str>) -> RouteMetrics {
        *alive().count.entry(label.clone()).or_default() += 1;
        RouteMetrics {
            label: label.clone(),
            request_duration: Lazy::new(label, |m, l| m.request_duration.with_label_values(l)),
            upstream_duration: Lazy::new(label, |m, l| m.upstream_duration.with_label_values(l)),
            queue_wait: Lazy::new(label, |m, l| m.queue_wait.with_label_values(l)),
            in_flight: Lazy::new(label, |m, l| m.in_flight.with_label_values(l)),
            cost_units: Lazy::new(label, |m, l| m.cost_units.with_label_values(l)),
            overhead: Lazy::new(label, |m, l| m.overhead.with_label_values(l)),
            admitted_duration: Lazy::new(label, |m, l| m.admitted_duration.with_label_values(l)),
            stated: StatedCosts::default(),
            statuses: Default::default(),
            recent: OnceLock::new(),
            limit: Mutex::default(),
        }
    }

    /// Puts `tollgate_in_flight_limit` out, and keeps it so from now on (`cap` on reloads).
    fn publish_limit(&self) {
        let mut l = crate::store::lock(&self.limit);
        l.published = true;
        l.show(&self.label);
    }

    /// A config put in force: the route's cap (`None`: uncapped), shown if its series is out
    /// or `now`.
    fn set_limit(&self, cap: Option<u32>, now: bool) {
        let mut l = crate::store::lock(&self.limit);
        l.cap = cap;
        l.published |= now;
        if l.published {
            l.show(&self.label);
        }
    }

    /// Creates, at zero, the series of the answers an alert or a dashboard rate watches for —
    /// a counter that first appears at N is invisible to `rate()` until it grows again, so a
    /// route's first 429 storm or 5xx burst after a start would go unseen. Of the histograms
    /// only the one the alerts read (`tollgate_admitted_duration_seconds`) and a capped route's
    /// queue wait (its first burst of waiters must show): the others are for dashboards'
    /// latency quantiles and come with the route's first request. At 25 lines each they were
    /// most of an idle scrape (200 routes: 1.7 MB of the 2 MB DESIGN allows).
    fn announce(&self, route: &Route) {
        let m = metrics();
        let _: &Histogram = &self.admitted_duration;
        if route.max_in_flight.is_some() {
            let _: &Histogram = &self.queue_wait;
        }
        let _: &IntGauge = &self.in_flight;
        let _: &IntCounter = &self.cost_units;
        for status in ANNOUNCED_STATUSES {
            if let Some(i) = COMMON_STATUSES.iter().position(|s| *s == status) {
                let _ = self.statuses[i].get_or_init(|| {
                    m.requests
                        .with_label_values(&[&*self.label, &status.to_string()])
                });
            }
        }
        // A capped route's `tollgate_queued` comes with its limit (`Limit::show`), at zero:
        // a queue's first waiters must show.
        let mut reasons = vec![Reason::Budget, Reason::KeyInFlight];
        if route.max_in_flight.is_some() {
            reasons.extend([Reason::InFlight, Reason::RouteBusy]);
        }
        if route.shared().is_some() {
            reasons.push(Reason::SharedBudget);
        }
        let refusals = if route.fidelity.shadow {
            &m.shadow_rejections
        } else {
            &m.rejections
        };
        for reason in reasons {
            refusals.with_label_values(&[&*self.label, reason.as_str()]);
        }
        if route.fidelity.cost_from_response.is_some() {
            for result in stated::RESULTS {
                m.cost_reports.with_label_values(&[&*self.label, result]);
            }
        }
    }

    /// Counts what a response of a `cost_from_response` route said about its cost.
    pub fn cost_report(&self, report: Report) {
        metrics()
            .cost_reports
            .with_label_values(&[&*self.label, report.label()])
            .inc();
        if let Report::Applied(units) = report {
            self.stated.add(units);
        }
    }

    /// Counts one answered request.
    pub fn request(&self, status: u16) {
        let series = || {
            metrics()
                .requests
                .with_label_values(&[&*self.label, &status.to_string()])
        };
        match COMMON_STATUSES.iter().position(|s| *s == status) {
            Some(i) => self.statuses[i].get_or_init(series).inc(),
            None => series().inc(),
        }
    }

    /// Counts a request in the last minute's figures: admitted (when the decision is made,
    /// shadow mode's included) or refused (when its refusal is answered).
    /// `at`: when, from an instant the request has read anyway (no clock read here).
    pub fn count_recent(&self, admitted: bool, at: std::time::Instant) {
        self.recent
            .get_or_init(|| {
                // The route's first traffic: its limit, if it was not announced.
                self.publish_limit();
                Box::default()
            })
            .count(recent::second_of(at), admitted);
    }

    /// The last minute's admitted and refused requests (zeros for a route without any).
    pub fn recent(&self) -> Counts {
        self.recent
            .get()
            .map(|r| r.sum(recent::now_second()))
            .unwrap_or_default()
    }

    /// Counts a refusal that `mode: shadow` did not make.
    pub fn shadow_rejection(&self, reason: Reason) {
        metrics()
            .shadow_rejections
            .with_label_values(&[&*self.label, reason.as_str()])
            .inc();
    }

    /// Counts a refusal by the gateway.
    pub fn rejection(&self, reason: Reason) {
        metrics()
            .rejections
            .with_label_values(&[&*self.label, reason.as_str()])
            .inc();
    }
}

/// A route's `tollgate_in_flight_limit`: its cap, and whether the series is out.
#[derive(Debug, Default)]
struct Limit {
    cap: Option<u32>,
    published: bool,
}

impl Limit {
    /// The series at the cap, and the route's queue (at zero while nobody waits); the limit
    /// removed for an uncapped route.
    fn show(&self, label: &str) {
        let m = metrics();
        match self.cap {
            Some(cap) => {
                m.in_flight_limit
                    .with_label_values(&[label])
                    .set(i64::from(cap));
                let _ = m.queued.with_label_values(&[label]);
            }
            None => {
                let _ = m.in_flight_limit.remove_label_values(&[label]);
            }
        }
    }
}

/// The costs a route's upstream stated and were applied: how many, and their sum.
#[derive(Debug, Default)]
pub struct StatedCosts {
    count: AtomicU64,
    sum: AtomicU64,
}

impl StatedCosts {
    fn add(&self, units: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(units, Ordering::Relaxed);
    }

    /// `(count, sum)` so far (read separately: a report in between skews one mean by one).
    pub fn read(&self) -> (u64, u64) {
        (
            self.count.load(Ordering::Relaxed),
            self.sum.load(Ordering::Relaxed),
        )
    }
}

/// The series of every route of one config, indexed by [`Route::index`]. Only a running
/// gateway builds one (parsing a config registers nothing); a reload reuses the handles of
/// routes it keeps, so counters and in-flight gauges carry on.
#[derive(Debug)]
pub struct RouteMetricsTable {
    by_index: Vec<Arc<RouteMetrics>>,
}

impl RouteMetricsTable {
    pub fn new(router: &Router, previous: Option<&RouteMetricsTable>) -> RouteMetricsTable {
        // By label, so that a reload of 20,000 endpoints is not 20,000² comparisons.
        let previous: std::collections::HashMap<&str, &Arc<RouteMetrics>> = previous
            .map(|p| p.by_index.iter().map(|x| (&*x.label, x)).collect())
            .unwrap_or_default();
        // Series for routes without traffic exist for the first [`ANNOUNCED_ROUTES`] only
        // (DESIGN §5), capped or not: 20,000 capped routes' would be ~40 MB of zeros.
        let by_index = router
            .routes()
            .map(|r| {
                let announced = r.index < ANNOUNCED_ROUTES || &*r.label == "default";
                let rm = previous
                    .get(&*r.label)
                    .map(|x| Arc::clone(x))
                    .unwrap_or_else(|| {
                        let rm = RouteMetrics::new(&r.label);
                        if announced {
                            rm.announce(r);
                        }
                        Arc::new(rm)
                    });
                rm.set_limit(r.max_in_flight, announced);
                rm
            })
            .collect();
        RouteMetricsTable { by_index }
    }

    pub fn get(&self, route: &Route) -> &RouteMetrics {
        // A route always comes from the router this table was built from; `default` is last.
        match self.by_index.get(route.index) {
            Some(m) => m,
            None => &self.by_index[self.by_index.len() - 1],
        }
    }

    /// Removes the in-flight limits and queues of routes that `next` keeps without a cap. (A
    /// route `next` no longer has keeps its series until its last request has ended:
    /// [`retire_pending`].)
    pub fn retire(&self, next: &Router) {
        let m = metrics();
        let next: std::collections::HashMap<&str, &Route> =
            next.routes().map(|r| (&*r.label, r)).collect();
        for old in &self.by_index {
            let label = &*old.label;
            if next.get(label).is_some_and(|r| r.max_in_flight.is_none()) {
                // Nobody queues on a route without a cap: its queue goes with its limit.
                let _ = m.in_flight_limit.remove_label_values(&[label]);
                let _ = m.queued.remove_label_values(&[label]);
            }
        }
    }
}

/// Removes every series of a `{route, ...}` counter whose route is `label`.
fn remove_route_series(vec: &IntCounterVec, routes: &std::collections::HashSet<&str>) {
    use prometheus::core::Collector;
    for family in vec.collect() {
        for metric in family.get_metric() {
            let labels: std::collections::HashMap<&str, &str> = metric
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            if labels.get("route").is_some_and(|r| routes.contains(r)) {
                let _ = vec.remove(&labels);
            }
        }
    }
}
