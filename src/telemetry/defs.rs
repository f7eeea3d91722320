//! The name, help text, labels and buckets of every metric [`super::Metrics`] holds: the
//! contract of DESIGN §5 as one table, so that registering them is one line each.

use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts,
};

/// One metric's definition.
pub struct Def {
    pub name: &'static str,
    pub help: &'static str,
    /// Empty for a metric without labels.
    pub labels: &'static [&'static str],
    /// Empty for anything but a histogram.
    pub buckets: &'static [f64],
}

/// Registration only fails on a name clash, which is a bug caught by any test.
#[allow(clippy::expect_used)]
fn register<C: prometheus::core::Collector + Clone + 'static>(c: prometheus::Result<C>) -> C {
    let c = c.expect("register");
    prometheus::register(Box::new(c.clone())).expect("register");
    c
}

impl Def {
    fn opts(&self) -> Opts {
        Opts::new(self.name, self.help)
    }

    fn histogram_opts(&self) -> HistogramOpts {
        HistogramOpts::new(self.name, self.help).buckets(self.buckets.to_vec())
    }

    pub fn counter(&self) -> IntCounter {
        register(IntCounter::with_opts(self.opts()))
    }

    pub fn counter_vec(&self) -> IntCounterVec {
        register(IntCounterVec::new(self.opts(), self.labels))
    }

    pub fn gauge(&self) -> IntGauge {
        register(IntGauge::with_opts(self.opts()))
    }

    pub fn float_gauge(&self) -> Gauge {
        register(Gauge::with_opts(self.opts()))
    }

    pub fn gauge_vec(&self) -> IntGaugeVec {
        register(IntGaugeVec::new(self.opts(), self.labels))
    }

    pub fn histogram(&self) -> Histogram {
        register(Histogram::with_opts(self.histogram_opts()))
    }

    pub fn histogram_vec(&self) -> HistogramVec {
        register(HistogramVec::new(self.histogram_opts(), self.labels))
    }
}

pub const REQUESTS: Def = Def {
    name: "tollgate_requests_total",
    help: "Requests answered, by route and HTTP status",
    labels: &["route", "status"],
    buckets: &[],
};

pub const REQUEST_DURATION: Def = Def {
    name: "tollgate_request_duration_seconds",
    help: "Whole request time in the gateway",
    labels: &["route"],
    buckets: super::LATENCY_BUCKETS,
};

pub const UPSTREAM_DURATION: Def = Def {
    name: "tollgate_upstream_duration_seconds",
    help: "Time from sending the request to the upstream until its response head arrived (a body streamed after it is not counted)",
    labels: &["route"],
    buckets: super::LATENCY_BUCKETS,
};

pub const REJECTIONS: Def = Def {
    name: "tollgate_rejections_total",
    help: "Requests refused by the gateway, by route and reason",
    labels: &["route", "reason"],
    buckets: &[],
};

pub const COST_UNITS: Def = Def {
    name: "tollgate_cost_units_total",
    help: "Cost units charged to admitted requests",
    labels: &["route"],
    buckets: &[],
};

pub const IN_FLIGHT: Def = Def {
    name: "tollgate_in_flight",
    help: "Requests admitted and not finished, this instance",
    labels: &["route"],
    buckets: &[],
};

pub const IN_FLIGHT_LIMIT: Def = Def {
    name: "tollgate_in_flight_limit",
    help: "Configured fleet-wide max_in_flight of capped routes",
    labels: &["route"],
    buckets: &[],
};

pub const QUEUE_WAIT: Def = Def {
    name: "tollgate_queue_wait_seconds",
    help: "Time spent waiting for a route's in-flight slot",
    labels: &["route"],
    buckets: super::LATENCY_BUCKETS,
};

pub const QUEUED: Def = Def {
    name: "tollgate_queued",
    help: "Requests of this instance waiting for a slot of a capped route",
    labels: &["route"],
    buckets: &[],
};

pub const STORE_CALLS: Def = Def {
    name: "tollgate_store_calls_total",
    help: "Calls to the shared store by result",
    labels: &["result"],
    buckets: &[],
};

pub const STORE_DURATION: Def = Def {
    name: "tollgate_store_duration_seconds",
    help: "Duration of calls to the shared store",
    labels: &[],
    buckets: super::STORE_BUCKETS,
};

pub const STORE_DEGRADED: Def = Def {
    name: "tollgate_store_degraded",
    help: "1 while decisions follow store.on_error instead of the shared store",
    labels: &[],
    buckets: &[],
};

pub const STORE_EVICTION_UNSAFE: Def = Def {
    name: "tollgate_store_eviction_unsafe",
    help: "1 while Redis's maxmemory-policy can evict tollgate's keys",
    labels: &[],
    buckets: &[],
};

pub const CONFIG_RELOADS: Def = Def {
    name: "tollgate_config_reloads_total",
    help: "Configuration reloads by result",
    labels: &["result"],
    buckets: &[],
};

pub const REJECTIONS_BY_PLAN: Def = Def {
    name: "tollgate_rejections_by_plan_total",
    help: "Rejections of identified callers, by plan (bounded by the plans in gateway.yaml)",
    labels: &["plan"],
    buckets: &[],
};

pub const REJECTIONS_BY_KEY: Def = Def {
    name: "tollgate_rejections_by_key_total",
    help: "Rejections of registry keys, by registry id",
    labels: &["key"],
    buckets: &[],
};

pub const SHADOW_REJECTIONS: Def = Def {
    name: "tollgate_shadow_rejections_total",
    help: "Rejections that shadow mode would have made",
    labels: &["route", "reason"],
    buckets: &[],
};

pub const CONNECTIONS: Def = Def {
    name: "tollgate_connections",
    help: "Open client connections, this instance",
    labels: &[],
    buckets: &[],
};

pub const CONNECTIONS_REFUSED: Def = Def {
    name: "tollgate_connections_refused_total",
    help: "Client connections refused because server.max_connections were open",
    labels: &[],
    buckets: &[],
};

pub const ACCEPT_BACKOFF: Def = Def {
    name: "tollgate_accept_backoff_total",
    help: "Times a listener (proxy or admin) paused accepting because the process or system ran out of file descriptors (or memory)",
    labels: &["listener"],
    buckets: &[],
};

pub const CLIENT_TIMEOUTS: Def = Def {
    name: "tollgate_client_timeouts_total",
    help: "Client connections closed for being too slow: header, body or send",
    labels: &["kind"],
    buckets: &[],
};

pub const OVERHEAD: Def = Def {
    name: "tollgate_overhead_seconds",
    help: "Admitted requests: time in the gateway minus upstream time and queue/hold time",
    labels: &["route"],
    buckets: super::OVERHEAD_BUCKETS,
};

pub const ADMITTED_DURATION: Def = Def {
    name: "tollgate_admitted_duration_seconds",
    help: "Whole request time in the gateway, admitted (forwarded) requests only: the latency SLO",
    labels: &["route"],
    buckets: super::LATENCY_BUCKETS,
};

pub const BUILD_INFO: Def = Def {
    name: "tollgate_build_info",
    help: "1, labelled with the running tollgate version",
    labels: &["version"],
    buckets: &[],
};

pub const CONFIG_INFO: Def = Def {
    name: "tollgate_config_info",
    help: "1, labelled with the hash of the running gateway.yaml",
    labels: &["hash"],
    buckets: &[],
};

pub const CONFIG_LAST_RELOAD: Def = Def {
    name: "tollgate_config_last_reload_timestamp_seconds",
    help: "Unix time when the running config was loaded (start or reload)",
    labels: &[],
    buckets: &[],
};

pub const FALLBACK_DECISIONS: Def = Def {
    name: "tollgate_fallback_decisions_total",
    help: "Decisions made by store.on_error while the shared store was unreachable",
    labels: &["decision"],
    buckets: &[],
};

pub const COST_REPORTS: Def = Def {
    name: "tollgate_cost_reports_total",
    help: "Responses of cost_from_response routes, by what their stated cost was: applied|missing|invalid",
    labels: &["route", "result"],
    buckets: &[],
};
