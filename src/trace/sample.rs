//! The sampler: parent-based over a trace-id ratio (the SDK's own samplers), held so that a
//! reload can put a new ratio in force.

use std::sync::Arc;

use arc_swap::ArcSwap;
use opentelemetry::trace::{Link, SamplingResult, SpanKind, TraceId};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{Sampler, ShouldSample};

/// `ParentBased(TraceIdRatioBased(ratio))`: a sampled parent is followed, an unsampled one
/// too (unsampled), and a new trace is recorded for `ratio` of trace ids.
#[derive(Debug, Clone)]
pub(super) struct Sampling {
    current: Arc<ArcSwap<(f64, Sampler)>>,
}

fn parent_based(ratio: f64) -> (f64, Sampler) {
    (
        ratio,
        Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))),
    )
}

impl Sampling {
    pub(super) fn new(ratio: f64) -> Sampling {
        Sampling {
            current: Arc::new(ArcSwap::from_pointee(parent_based(ratio))),
        }
    }

    /// Puts `ratio` in force; false when it already was.
    pub(super) fn set_ratio(&self, ratio: f64) -> bool {
        if self.current.load().0 == ratio {
            return false;
        }
        self.current.store(Arc::new(parent_based(ratio)));
        true
    }
}

impl ShouldSample for Sampling {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        self.current.load().1.should_sample(
            parent_context,
            trace_id,
            name,
            span_kind,
            attributes,
            links,
        )
    }
}
