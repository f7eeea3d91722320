//! What an SRE sees: the Prometheus metrics of DESIGN §5 and the log setup.
//!
//! Metrics live in the `prometheus` crate's default registry — the one Pingora's own metrics
//! use — so `/metrics` shows both. Names and labels are contract; `route` is always an endpoint
//! pattern or `default`, and per-key series only ever carry registry ids.

pub mod access;
mod defs;
mod labels;
mod logging;
#[cfg(target_os = "linux")]
mod process;
pub mod recent;
mod routes;
mod timing;

use std::sync::OnceLock;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

/// Buckets for request, upstream and queue times: 1 ms to 60 s, close enough above 1 s that
/// a 10–45 s report's percentiles are not interpolated across a factor of two.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
];
/// Buckets for the time the gateway itself adds: 10 µs to 1 s.
pub const OVERHEAD_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 1.0,
];
/// Buckets for store calls: 100 µs to 1 s (the default store timeout is 250 ms).
pub const STORE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Counts a request in `tollgate_queued{route}` while it waits for a route's slot.
pub struct Queued(IntGauge);

impl Queued {
    pub fn new(route: &str) -> Queued {
        let g = metrics().queued.with_label_values(&[route]);
        g.inc();
        Queued(g)
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Every metric the gateway exports (the dashboard test checks against this list).
pub const METRIC_NAMES: &[&str] = &[
    "tollgate_requests_total",
    "tollgate_request_duration_seconds",
    "tollgate_upstream_duration_seconds",
    "tollgate_rejections_total",
    "tollgate_cost_units_total",
    "tollgate_in_flight",
    "tollgate_in_flight_limit",
    "tollgate_queue_wait_seconds",
    "tollgate_queued",
    "tollgate_store_calls_total",
    "tollgate_store_duration_seconds",
    "tollgate_store_degraded",
    "tollgate_store_eviction_unsafe",
    "tollgate_config_reloads_total",
    "tollgate_rejections_by_key_total",
    "tollgate_rejections_by_plan_total",
    "tollgate_shadow_rejections_total",
    "tollgate_connections",
    "tollgate_connections_refused_total",
    "tollgate_accept_backoff_total",
    "tollgate_client_timeouts_total",
    "tollgate_overhead_seconds",
    "tollgate_admitted_duration_seconds",
    "tollgate_build_info",
    "tollgate_config_info",
    "tollgate_config_last_reload_timestamp_seconds",
    "tollgate_fallback_decisions_total",
    "tollgate_cost_reports_total",
    // Registered by `jobs::metrics` (series only for routes with `async:`).
    "tollgate_jobs_total",
    "tollgate_jobs",
    // Registered only when `tracing:` is on (crate::trace).
    "tollgate_trace_spans_dropped_total",
];

pub struct Metrics {
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub upstream_duration: HistogramVec,
    pub rejections: IntCounterVec,
    pub cost_units: IntCounterVec,
    pub in_flight: IntGaugeVec,
    pub in_flight_limit: IntGaugeVec,
    pub queue_wait: HistogramVec,
    pub queued: IntGaugeVec,
    pub store_calls: IntCounterVec,
    pub store_duration: Histogram,
    pub store_degraded: IntGauge,
    pub store_eviction_unsafe: IntGauge,
    pub config_reloads: IntCounterVec,
    pub rejections_by_key: IntCounterVec,
    pub rejections_by_plan: IntCounterVec,
    pub shadow_rejections: IntCounterVec,
    pub connections: IntGauge,
    pub connections_refused: IntCounter,
    pub accept_backoff: IntCounterVec,
    pub client_timeouts: IntCounterVec,
    pub overhead: HistogramVec,
    pub admitted_duration: HistogramVec,
    pub build_info: IntGaugeVec,
    pub config_info: IntGaugeVec,
    pub config_last_reload: prometheus::Gauge,
    pub fallback_decisions: IntCounterVec,
    pub cost_reports: IntCounterVec,
}

fn build() -> Metrics {
    Metrics {
        requests: defs::REQUESTS.counter_vec(),
        request_duration: defs::REQUEST_DURATION.histogram_vec(),
        upstream_duration: defs::UPSTREAM_DURATION.histogram_vec(),
        rejections: defs::REJECTIONS.counter_vec(),
        cost_units: defs::COST_UNITS.counter_vec(),
        in_flight: defs::IN_FLIGHT.gauge_vec(),
        in_flight_limit: defs::IN_FLIGHT_LIMIT.gauge_vec(),
        queue_wait: defs::QUEUE_WAIT.histogram_vec(),
        queued: defs::QUEUED.gauge_vec(),
        store_calls: defs::STORE_CALLS.counter_vec(),
        store_duration: defs::STORE_DURATION.histogram(),
        store_degraded: defs::STORE_DEGRADED.gauge(),
        store_eviction_unsafe: defs::STORE_EVICTION_UNSAFE.gauge(),
        config_reloads: defs::CONFIG_RELOADS.counter_vec(),
        rejections_by_plan: defs::REJECTIONS_BY_PLAN.counter_vec(),
        rejections_by_key: defs::REJECTIONS_BY_KEY.counter_vec(),
        shadow_rejections: defs::SHADOW_REJECTIONS.counter_vec(),
        connections: defs::CONNECTIONS.gauge(),
        connections_refused: defs::CONNECTIONS_REFUSED.counter(),
        accept_backoff: defs::ACCEPT_BACKOFF.counter_vec(),
        client_timeouts: defs::CLIENT_TIMEOUTS.counter_vec(),
        overhead: defs::OVERHEAD.histogram_vec(),
        admitted_duration: defs::ADMITTED_DURATION.histogram_vec(),
        build_info: defs::BUILD_INFO.gauge_vec(),
        config_info: defs::CONFIG_INFO.gauge_vec(),
        config_last_reload: defs::CONFIG_LAST_RELOAD.float_gauge(),
        fallback_decisions: {
            let c = defs::FALLBACK_DECISIONS.counter_vec();
            // Both series from the start: an alert on their rate needs them before the outage.
            for d in FallbackDecision::ALL {
                c.with_label_values(&[d.as_str()]);
            }
            c
        },
        cost_reports: defs::COST_REPORTS.counter_vec(),
    }
}

impl Metrics {
    /// Counts a call to the shared store by its result.
    pub fn store_call(&self, result: StoreCall) {
        self.store_calls.with_label_values(&[result.as_str()]).inc();
    }

    pub fn config_reload(&self, result: Reload) {
        self.config_reloads
            .with_label_values(&[result.as_str()])
            .inc();
    }

    /// Counts a client connection closed for being too slow.
    pub fn client_timeout(&self, kind: ClientTimeout) {
        self.client_timeouts
            .with_label_values(&[kind.as_str()])
            .inc();
    }
}

pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = build();
        // Series that exist before the first event, so dashboards and alerts see zeros.
        for r in Reload::ALL {
            m.config_reloads.with_label_values(&[r.as_str()]);
        }
        for r in StoreCall::ALL {
            m.store_calls.with_label_values(&[r.as_str()]);
        }
        for k in ClientTimeout::ALL {
            m.client_timeouts.with_label_values(&[k.as_str()]);
        }
        for l in Listener::ALL {
            m.accept_backoff.with_label_values(&[l.as_str()]);
        }
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        // CPU, memory and file descriptors of this process (`process_*`).
        #[cfg(target_os = "linux")]
        process::register();
        m
    })
}

/// Says which config is running: `tollgate_config_info{hash}` (only the current hash has a
/// series) and the time it was loaded.
pub fn config_loaded(hash: &str) {
    let m = metrics();
    m.config_info.reset();
    m.config_info.with_label_values(&[hash]).set(1);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    m.config_last_reload.set(now);
}

/// Prometheus text exposition of the default registry.
pub fn render() -> String {
    use prometheus::Encoder;
    let enc = prometheus::TextEncoder::new();
    let mut buf = Vec::new();
    let _ = enc.encode(&prometheus::gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

pub use labels::{ClientTimeout, FallbackDecision, Listener, Reload, StoreCall};
pub use logging::{flush_logs, init_logging, LogFormat};
pub use routes::{retire_pending as retire_routes, RouteMetrics, RouteMetricsTable};
pub use timing::Timing;
