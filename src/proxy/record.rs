//! What a finished request leaves in the metrics and its trace: calls from `logging`, after
//! the slots were released and the charge settled.

use std::time::{Duration, Instant};

use pingora::Error;

use super::ctx::{Ctx, Phase};
use crate::route::Route;
use crate::telemetry::{metrics, RouteMetrics};
use crate::trace::{Finished, TraceHex, Tracing};

/// The request's metrics, once it is finished (and settled).
pub(super) fn finished(rm: &RouteMetrics, ctx: &Ctx, status: u16, elapsed: Duration, charged: u64) {
    rm.request(status);
    rm.request_duration.observe(elapsed.as_secs_f64());
    if ctx.was_forwarded() {
        // The latency SLO: refusals are fast and would flatter the requests that were served.
        rm.admitted_duration.observe(elapsed.as_secs_f64());
        rm.overhead.observe(ctx.overhead(elapsed).as_secs_f64());
    }
    // (One settled on its late answer is observed then, at the time it is billed.)
    if let (Some(u), false) = (ctx.timing.upstream, ctx.settles_late) {
        rm.upstream_duration.observe(u.as_secs_f64());
    }
    // A job's units are counted when it ends (the charge may be refunded or settled), and so
    // are those of a request settled on its late answer.
    if charged > 0 && !matches!(ctx.phase, Phase::Job { .. }) && !ctx.settles_late {
        rm.cost_units.inc_by(charged);
    }
    // Counted once settled: what the report made of the charge is in the store by now.
    if let Some(report) = ctx.report {
        rm.cost_report(report);
    }
    if let Phase::Refused {
        reason: Some(reason),
        ..
    } = ctx.phase
    {
        rm.rejection(reason);
        rm.count_recent(false, ctx.start + elapsed);
        if let Some(who) = &ctx.identity {
            if let Some(id) = who.id.as_deref() {
                metrics().rejections_by_key.with_label_values(&[id]).inc();
            }
            metrics()
                .rejections_by_plan
                .with_label_values(&[&who.policy.name])
                .inc();
        }
    }
}

/// Ends the request's spans (when tracing is on): the trace id, for the access log.
pub(super) fn trace(
    tracing: Option<&Tracing>,
    ctx: &mut Ctx,
    method: &str,
    route: &Route,
    status: u16,
    e: Option<&Error>,
) -> Option<TraceHex> {
    let (tracing, trace) = (tracing?, ctx.trace.take()?);
    let key = ctx.identity.as_ref().map(|i| i.log_name());
    Some(trace.finish(
        tracing,
        &Finished {
            method,
            route: &route.label,
            status,
            cost: ctx.final_charge(),
            decision: ctx.decision(),
            key_id: key.as_deref(),
            plan: ctx.identity.as_ref().map(|i| i.policy.name.as_str()),
            request_id: ctx.request_id.as_deref(),
            capped: route.max_in_flight.is_some(),
            timing: &ctx.timing,
            upstream_status: ctx.upstream.status,
            error: e.map(|e| e.etype().as_str()),
        },
    ))
}

/// A finished request's figures for its access-log line.
pub(super) struct Line<'a> {
    pub method: &'a str,
    pub route: &'a Route,
    pub status: u16,
    pub elapsed: Duration,
    pub charged: u64,
}

/// The request's access-log line (its fields are only evaluated when the log is on).
pub(super) fn access_line(ctx: &Ctx, l: &Line<'_>, trace_id: Option<&TraceHex>, e: Option<&Error>) {
    use crate::telemetry::access;
    if !access::enabled() {
        return;
    }
    let key = ctx.identity.as_ref().map(|i| i.log_name());
    access::write(&access::AccessRecord {
        method: l.method,
        route: &l.route.label,
        key: key.as_deref().unwrap_or("-"),
        cost: l.charged,
        decision: ctx.decision(),
        status: l.status,
        latency_ms: access::millis(l.elapsed),
        upstream_ms: ctx.timing.upstream.map(access::millis),
        store_ms: access::millis(ctx.timing.store),
        queue_ms: access::millis(ctx.timing.queued),
        hold_ms: access::millis(ctx.timing.hold),
        upstream_status: ctx.upstream.status,
        request_id: ctx.request_id.as_deref(),
        trace_id: trace_id.map(|t| t.as_str()),
        fallback: ctx.fallback,
        shadow: ctx.shadow_reason(),
        client: ctx.origin.map(|o| o.client),
        error: e.map(|e| e.etype().as_str()),
        job: ctx.job_id(),
    });
}

/// The gateway's whole answer to an HTTP/1 head Pingora refused before any hook: 400
/// `bad-request`, a problem JSON, and the connection closed (the rest of the stream cannot be
/// framed).
pub fn malformed_head_answer() -> bytes::Bytes {
    let r = crate::decision::malformed_head();
    let body = crate::problem::body(r.problem, &r.detail, None, None, None);
    let date = pingora::protocols::http::date::get_cached_date();
    let mut out = Vec::with_capacity(body.len() + 200);
    out.extend_from_slice(b"HTTP/1.1 400 Bad Request\r\nDate: ");
    out.extend_from_slice(date.as_bytes());
    out.extend_from_slice(
        b"\r\nContent-Type: application/problem+json\r\nCache-Control: no-store\r\n\
          Connection: close\r\nContent-Length: ",
    );
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(&body);
    out.into()
}

/// Counts and logs a head Pingora refused (see [`malformed_head_answer`]) as any refused
/// request is, under `default`: a request that never reached a hook, refused as malformed,
/// from `peer`, whose head took `elapsed`, under a generated request id. Nothing was charged
/// and no span exists.
pub fn malformed_head(
    shared: &crate::state::Shared,
    peer: Option<std::net::IpAddr>,
    elapsed: Duration,
) {
    let running = shared.running();
    let route = running.config.router.default_route();
    let mut ctx = Ctx::new(shared.drain.enter());
    ctx.start = Instant::now().checked_sub(elapsed).unwrap_or(ctx.start);
    ctx.refuse(&crate::decision::malformed_head());
    // Its access line has a request id like every other (DESIGN §5): a generated one, as the
    // client's could not be read.
    ctx.request_id = Some(super::new_request_id());
    ctx.origin = peer.map(|ip| crate::config::origin::Origin {
        peer: ip,
        client: ip,
        trusted_peer: false,
    });
    finished(running.metrics.get(route), &ctx, 400, elapsed, 0);
    let line = Line {
        method: "-",
        route,
        status: 400,
        elapsed,
        charged: 0,
    };
    let e = Error::new(pingora::ErrorType::InvalidHTTPHeader);
    access_line(&ctx, &line, None, Some(&e));
}
