//! The sampler: a sampled parent is followed; any other request (no parent, or an unsampled
//! one) is recorded for `sample_ratio` of trace ids (DESIGN §1, §9: the ratio is "for requests
//! without a sampled parent"); held so that a reload can put a new ratio in force.

use std::sync::Arc;

use arc_swap::ArcSwap;
use opentelemetry::trace::{Link, SamplingResult, SpanKind, TraceContextExt, TraceId};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{Sampler, ShouldSample};

/// A sampled parent is followed (`AlwaysOn`); a request without one — no parent, or a
/// client's unsampled parent, whose trace it continues — is recorded for `ratio` of trace
/// ids (`TraceIdRatioBased`). Unlike the SDK's `ParentBased`, a remote unsampled parent does
/// not decide: at `sample_ratio: 1.0` every request is recorded. The gateway's own spans'
/// children follow their parent's decision.
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
        let parent = parent_context.filter(|cx| cx.has_active_span()).map(|cx| {
            let p = cx.span();
            let p = p.span_context();
            (p.is_sampled(), p.is_remote())
        });
        let current = self.current.load();
        let sampler = match parent {
            // A sampled parent, the client's or the gateway's own: followed.
            Some((true, _)) => &Sampler::AlwaysOn,
            // The gateway's own unsampled span (a child's parent): not recorded either,
            // whatever the ratio is now (a reload may have changed it since).
            Some((false, false)) => &Sampler::AlwaysOff,
            // No parent, or the client's unsampled one: the ratio decides.
            _ => &current.1,
        };
        sampler.should_sample(parent_context, trace_id, name, span_kind, attributes, links)
    }
}
