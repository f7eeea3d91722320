//! The sampler: a sampled parent is followed; any other request (no parent, or an unsampled
//! one) is recorded for `sample_ratio` of trace ids (DESIGN §1, §9: the ratio is "for requests
//! without a sampled parent"); held so that a reload can put a new ratio in force.

use std::sync::Arc;

use arc_swap::ArcSwap;
use opentelemetry::trace::{Link, SamplingResult, SpanKind, TraceContextExt, TraceId};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{Sampler, ShouldSample};

/// A sampled parent is followed (`AlwaysOn`); a request without one — no parent, or an
/// unsampled parent, whose trace it continues — is recorded for `ratio` of trace ids
/// (`TraceIdRatioBased`). Unlike the SDK's `ParentBased`, an unsampled parent does not
/// decide: at `sample_ratio: 1.0` every request is recorded.
#[derive(Debug, Clone)]
pub(super) struct Sampling {
    current: Arc<ArcSwap<(f64, Sampler)>>,
}

fn by_ratio(ratio: f64) -> (f64, Sampler) {
    (ratio, Sampler::TraceIdRatioBased(ratio))
}

impl Sampling {
    pub(super) fn new(ratio: f64) -> Sampling {
        Sampling {
            current: Arc::new(ArcSwap::from_pointee(by_ratio(ratio))),
        }
    }

    /// Puts `ratio` in force; false when it already was.
    pub(super) fn set_ratio(&self, ratio: f64) -> bool {
        if self.current.load().0 == ratio {
            return false;
        }
        self.current.store(Arc::new(by_ratio(ratio)));
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
        let sampled_parent = parent_context
            .filter(|cx| cx.has_active_span())
            .is_some_and(|cx| cx.span().span_context().is_sampled());
        let current = self.current.load();
        let sampler = if sampled_parent {
            &Sampler::AlwaysOn
        } else {
            &current.1
        };
        sampler.should_sample(parent_context, trace_id, name, span_kind, attributes, links)
    }
}
