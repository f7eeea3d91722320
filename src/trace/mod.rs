//! OpenTelemetry traces (DESIGN §9): a span per request, exported over OTLP/HTTP.
//!
//! Only built when `tracing.otlp_endpoint` is set; without it the proxy holds no
//! [`RequestTrace`] and a client's `traceparent` goes upstream untouched. With it:
//! [`Tracing::begin`] continues the client's W3C trace context (or starts a trace, sampled
//! at `sample_ratio` — a parent-based sampler), [`RequestTrace::upstream_request`] gives the
//! upstream a `traceparent` whose parent is the gateway's upstream-call span, and
//! [`RequestTrace::finish`] writes the request's figures on its span, adds the store
//! decision, queue wait and `max_delay` hold as children, and ends it. A job's kept request
//! names its submission's span ([`RequestTrace::job_request`]); its run is a span under that
//! one, with the upstream call under it ([`Tracing::job_run`]). Export runs on a thread of its
//! own ([`export`]).

mod export;
mod request;
mod sample;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanExporter as _};
use opentelemetry_sdk::Resource;

use crate::config::TraceSettings;
pub use request::{Finished, JobTrace, RequestTrace, TraceHex};

/// How long one export request may take before its spans count as dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("cannot start the export thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("cannot register tollgate_trace_spans_dropped_total: {0}")]
    Metric(#[from] prometheus::Error),
}

/// The process's tracer: built once at start. A reload may change its `sample_ratio`; the
/// endpoint and the service name take effect on restart.
pub struct Tracing {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    propagator: TraceContextPropagator,
    sampler: sample::Sampling,
}

impl std::fmt::Debug for Tracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracing").finish_non_exhaustive()
    }
}

impl Tracing {
    /// Builds the exporter and starts its thread. Call outside any async runtime (the
    /// exporter's HTTP client is a blocking one).
    pub fn start(s: &TraceSettings) -> Result<Tracing, TraceError> {
        let resource = Resource::builder()
            .with_service_name(s.service_name.clone())
            .build();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(s.traces_url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()?;
        exporter.set_resource(&resource);
        let dropped = prometheus::register_int_counter!(
            "tollgate_trace_spans_dropped_total",
            "Finished spans that did not reach the collector (export queue full, or the export failed)"
        )?;
        let processor = export::Exporting::start(exporter, dropped)?;
        let sampler = sample::Sampling::new(s.sample_ratio);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler.clone())
            .with_resource(resource)
            .build();
        Ok(Tracing {
            tracer: provider.tracer("tollgate"),
            provider,
            propagator: TraceContextPropagator::new(),
            sampler,
        })
    }

    /// A reloaded config's `tracing:`: a new `sample_ratio` applies to the next requests
    /// (the rest is the running tracer's: `Config::keep_start_settings`).
    pub fn reload(running: Option<&Tracing>, new: Option<&TraceSettings>) {
        if let (Some(t), Some(n)) = (running, new) {
            if t.sampler.set_ratio(n.sample_ratio) {
                tracing::info!(
                    sample_ratio = n.sample_ratio,
                    "tracing.sample_ratio changed"
                );
            }
        }
    }

    /// Sends what is queued, waiting at most `timeout` (a dead collector must not hold up
    /// an exit).
    pub fn shutdown(&self, timeout: Duration) {
        if let Err(e) = self.provider.shutdown_with_timeout(timeout) {
            tracing::warn!(error = %e, "spans not exported before exit");
        }
    }
}
