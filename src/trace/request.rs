//! One request's spans: the server span (in a [`Context`], so that children name it as
//! their parent), the upstream call, and the children made from the request's timings when
//! it ends.

use std::borrow::Cow;
use std::time::{Duration, Instant, SystemTime};

use http::header::HeaderMap;
use http::HeaderName;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::Span;
use pingora::http::RequestHeader;

use super::Tracing;
use crate::telemetry::Timing;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The request's trace, from its first phase to `logging`.
pub struct RequestTrace {
    /// Holds the server span.
    cx: Context,
    /// The upstream call in progress or done (the last attempt's).
    upstream: Option<(Span, Instant)>,
    /// When the trace began, on both clocks: span times are `began` plus an `Instant`'s
    /// distance from it, so that the request's own timings place the children.
    began: (SystemTime, Instant),
    /// The client's `traceparent` was valid and continued (else its `tracestate`, which
    /// belongs to that parent, is not passed on).
    continued: bool,
}

/// What `logging` knows of the request when it ends.
pub struct Finished<'a> {
    pub method: &'a str,
    pub route: &'a str,
    pub status: u16,
    pub cost: u64,
    pub decision: crate::reason::Verdict,
    /// The registry id or `key:<8 hex>` (`Identity::log_name`): never the key.
    pub key_id: Option<&'a str>,
    pub plan: Option<&'a str>,
    pub request_id: Option<&'a str>,
    /// A capped route (`max_in_flight`): the queue wait is a span even when it was nothing.
    pub capped: bool,
    pub timing: &'a Timing,
    pub upstream_status: Option<u16>,
    pub error: Option<&'a str>,
}

/// A request's headers as the propagator reads them. A repeated `traceparent` is invalid
/// (W3C trace context §3.2): none is read then; repeated `tracestate`s are one list.
struct Headers<'a> {
    map: &'a HeaderMap,
    /// The `traceparent` the propagator reads: none when it is not well formed (below), with
    /// only the `sampled` flag kept.
    traceparent: Option<Cow<'a, str>>,
}

impl<'a> Headers<'a> {
    fn of(map: &'a HeaderMap) -> Headers<'a> {
        let traceparent = one(map, TRACEPARENT.as_str()).and_then(well_formed);
        Headers { map, traceparent }
    }
}

/// The header's value when it is there once.
fn one<'m>(map: &'m HeaderMap, key: &str) -> Option<&'m str> {
    let mut all = map.get_all(key).iter();
    match (all.next(), all.next()) {
        (Some(v), None) => v.to_str().ok(),
        _ => None,
    }
}

/// A `traceparent` as W3C trace context §3.2 has it — `version-trace_id-parent_id-flags`, two,
/// 32, 16 and two lower-case hex digits (after version 00 nothing more; a later version may
/// add `-…` fields, read as 00), version `ff` invalid — as version 00 with only the `sampled`
/// flag kept; `None` when it is not one (a new trace begins, its `tracestate` dropped). The
/// SDK's propagator is laxer (`+1`, `1`, a 31-digit id, a trailing `-` pass; `from_str_radix`
/// takes a sign) and stricter (flags above 02 fail: Level 2's `random` bit, 0x02, set by newer
/// SDKs beside `sampled`, would start a new trace under a sampled parent; DESIGN §9).
fn well_formed(v: &str) -> Option<Cow<'_, str>> {
    let v = v.trim();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = v.splitn(5, '-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let more = parts.next().is_some();
    let fields_ok = hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2);
    if !fields_ok || version == "ff" || (more && version == "00") {
        return None;
    }
    if version == "00" && (flags == "00" || flags == "01") {
        // The common header, read as it came (no copy per request).
        return Some(Cow::Borrowed(v));
    }
    let f = u8::from_str_radix(flags, 16).ok()?;
    Some(Cow::Owned(format!("00-{trace}-{parent}-{:02x}", f & 1)))
}

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if key == TRACEPARENT.as_str() {
            return self.traceparent.as_deref();
        }
        one(self.map, key)
    }

    fn keys(&self) -> Vec<&str> {
        self.map.keys().map(|k| k.as_str()).collect()
    }
}

impl Tracing {
    /// The request's server span: a child of the client's `traceparent` when it carries a
    /// valid one, else the root of a new trace.
    pub fn begin(&self, headers: &HeaderMap) -> Box<RequestTrace> {
        let began = (SystemTime::now(), Instant::now());
        let parent = self.propagator.extract(&Headers::of(headers));
        let continued = parent.span().span_context().is_valid();
        let span = self
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .with_start_time(began.0)
            .start_with_context(&self.tracer, &parent);
        Box::new(RequestTrace {
            cx: parent.with_span(span),
            upstream: None,
            began,
            continued,
        })
    }
}

impl RequestTrace {
    fn at(&self, t: Instant) -> SystemTime {
        self.began.0 + t.saturating_duration_since(self.began.1)
    }

    fn trace_id(&self) -> TraceHex {
        TraceHex::new(self.cx.span().span_context().trace_id())
    }

    /// Starts the upstream-call span, and names the request's (server) span in the request's
    /// `traceparent` (DESIGN §9: "naming the gateway's span as parent"); the client's
    /// `tracestate` stays as it came (removed when its parent was not continued).
    pub fn upstream_request(
        &mut self,
        tracing: &Tracing,
        upstream: &mut RequestHeader,
    ) -> pingora::Result<()> {
        let now = Instant::now();
        if let Some((mut earlier, _)) = self.upstream.take() {
            // Pingora tries again (a connection that failed): that attempt ends here.
            earlier.end_with_timestamp(self.at(now));
        }
        let mut span = tracing
            .tracer
            .span_builder("upstream")
            .with_kind(SpanKind::Client)
            .with_start_time(self.at(now))
            .start_with_context(&tracing.tracer, &self.cx);
        if span.is_recording() {
            let method = known_method(upstream.method.as_str()).unwrap_or("_OTHER");
            span.set_attribute(KeyValue::new("http.request.method", method));
        }
        name_parent(upstream, self.cx.span().span_context(), self.continued)?;
        self.upstream = Some((span, now));
        Ok(())
    }

    /// A job's request, as it is kept until the job runs: its `traceparent` names this
    /// request's (the submission's) span, under which the run's spans go, on whichever
    /// instance runs it ([`Tracing::job_run`]).
    pub fn job_request(&self, job: &mut RequestHeader) -> pingora::Result<()> {
        name_parent(job, self.cx.span().span_context(), self.continued)
    }

    /// Ends the request's spans with what it came to. Returns the trace id. An unsampled
    /// request's spans record nothing: they are only dropped.
    pub fn finish(mut self, tracing: &Tracing, f: &Finished<'_>) -> TraceHex {
        let id = self.trace_id();
        if !self.cx.span().is_recording() {
            return id;
        }
        let end = SystemTime::now();
        self.children(tracing, f);
        if let Some((mut span, started)) = self.upstream.take() {
            match f.upstream_status {
                Some(status) => span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                )),
                None => {
                    span.set_status(Status::error(f.error.unwrap_or("no response").to_string()))
                }
            }
            let until = f.timing.upstream.map_or(end, |d| self.at(started + d));
            span.end_with_timestamp(until);
        }
        let span = self.cx.span();
        span.update_name(span_name(f.method, f.route));
        span.set_attributes(attributes(f));
        // A server's error (a 499, the client gone, is not one; OpenTelemetry's HTTP
        // conventions leave 4xx server spans unset).
        if f.status >= 500 {
            span.set_status(Status::error(f.decision.as_str().to_string()));
        }
        span.end_with_timestamp(end);
        id
    }

    /// The store's decision, the `max_delay` hold and the wait for a slot, one after the
    /// other from when the store was asked, in the order they happen: a capped route's
    /// request is held for its turn before it joins the queue (`crate::hold`).
    fn children(&self, tracing: &Tracing, f: &Finished<'_>) {
        let Some(asked) = f.timing.asked else {
            return;
        };
        let t = f.timing;
        let mut parts = vec![("store decision", t.store)];
        if !t.hold.is_zero() {
            parts.push(("max_delay hold", t.hold));
        }
        if f.capped {
            parts.push(("queue wait", t.queued));
        }
        let mut from = asked;
        for (name, length) in parts {
            let mut span = tracing
                .tracer
                .span_builder(name)
                .with_start_time(self.at(from))
                .start_with_context(&tracing.tracer, &self.cx);
            from += length;
            span.end_with_timestamp(self.at(from));
        }
    }
}

/// Names `parent` in the request's `traceparent`; the client's `tracestate` stays as it came,
/// removed when its parent was not continued (it belongs to that parent).
fn name_parent(
    req: &mut RequestHeader,
    parent: &SpanContext,
    continued: bool,
) -> pingora::Result<()> {
    let traceparent = format!(
        "00-{}-{}-{:02x}",
        parent.trace_id(),
        parent.span_id(),
        parent.trace_flags().to_u8() & 1
    );
    req.insert_header(TRACEPARENT, traceparent)?;
    if !continued && req.headers.contains_key(&TRACESTATE) {
        req.remove_header(&TRACESTATE);
    }
    Ok(())
}

/// A job's run (DESIGN §8), on the instance that got its slot: a span under the submission's,
/// and the upstream call under it once a connection is made.
pub struct JobTrace {
    /// Holds the run's span.
    cx: Context,
    /// The job's `traceparent` was valid and continued (else its `tracestate` is not passed on).
    continued: bool,
    upstream: Option<Span>,
}

impl Tracing {
    /// Starts a job's run: its span is a child of the span its request's `traceparent` names
    /// (the submission's, see [`RequestTrace::job_request`], or the client's when the
    /// submitting instance did not trace).
    /// The run's span starts when the job began to wait for its slot (`queued` ago), with
    /// that wait as its first child, `queue wait` (DESIGN §9), as a request's.
    pub fn job_run(
        &self,
        route: &str,
        job_id: &str,
        request: &RequestHeader,
        queued: Duration,
    ) -> JobTrace {
        let parent = self.propagator.extract(&Headers::of(&request.headers));
        let continued = parent.span().span_context().is_valid();
        let now = SystemTime::now();
        let waited_from = now.checked_sub(queued).unwrap_or(now);
        let mut span = self
            .tracer
            .span_builder(format!("job {route}"))
            .with_kind(SpanKind::Consumer)
            .with_start_time(waited_from)
            .start_with_context(&self.tracer, &parent);
        if span.is_recording() {
            let method = known_method(request.method.as_str()).unwrap_or("_OTHER");
            span.set_attributes([
                KeyValue::new("http.request.method", method),
                KeyValue::new("http.route", route.to_string()),
                KeyValue::new("tollgate.job_id", job_id.to_string()),
            ]);
        }
        let cx = parent.with_span(span);
        self.tracer
            .span_builder("queue wait")
            .with_start_time(waited_from)
            .start_with_context(&self.tracer, &cx)
            .end_with_timestamp(now);
        JobTrace {
            cx,
            continued,
            upstream: None,
        }
    }
}

impl JobTrace {
    /// The job's request is about to be written on a connection to the upstream: the
    /// upstream-call span starts, and the run's span is named in the request's `traceparent`
    /// (as a request's own span is). A header that cannot be set leaves the request as it
    /// was: tracing never fails a job.
    pub fn upstream_request(&mut self, tracing: &Tracing, upstream: &mut RequestHeader) {
        let mut call = tracing
            .tracer
            .span_builder("upstream")
            .with_kind(SpanKind::Client)
            .start_with_context(&tracing.tracer, &self.cx);
        if call.is_recording() {
            let method = known_method(upstream.method.as_str()).unwrap_or("_OTHER");
            call.set_attribute(KeyValue::new("http.request.method", method));
        }
        if let Err(e) = name_parent(upstream, self.cx.span().span_context(), self.continued) {
            tracing::debug!(error = %e, "a job's traceparent could not be set");
        }
        self.upstream = Some(call);
    }

    /// Ends the run's spans: `status` is the job's result (the upstream's answer, or the
    /// gateway's 502/504), `upstream_status` the upstream's own, `error` why it failed.
    pub fn finish(mut self, status: u16, upstream_status: Option<u16>, error: Option<&str>) {
        if let Some(mut call) = self.upstream.take() {
            match upstream_status {
                Some(s) => {
                    call.set_attribute(KeyValue::new("http.response.status_code", i64::from(s)))
                }
                None => call.set_status(Status::error(error.unwrap_or("no response").to_string())),
            }
            call.end();
        }
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if let Some(e) = error {
            span.set_attribute(KeyValue::new("error.type", e.to_string()));
        }
        if status >= 500 {
            span.set_status(Status::error(error.unwrap_or("failed").to_string()));
        }
        span.end();
    }
}

/// The server span's attributes (OpenTelemetry's HTTP names, and tollgate's own).
fn attributes(f: &Finished<'_>) -> Vec<KeyValue> {
    let method = known_method(f.method).unwrap_or("_OTHER");
    let mut attrs = vec![
        KeyValue::new("http.request.method", method),
        KeyValue::new("http.route", f.route.to_string()),
        KeyValue::new("http.response.status_code", i64::from(f.status)),
        KeyValue::new("tollgate.cost", i64::try_from(f.cost).unwrap_or(i64::MAX)),
        KeyValue::new("tollgate.decision", f.decision.as_str()),
    ];
    let optional = [
        ("tollgate.key_id", f.key_id),
        ("tollgate.plan", f.plan),
        ("tollgate.request_id", f.request_id),
        ("error.type", f.error),
        (
            "http.request.method_original",
            (method == "_OTHER").then_some(f.method),
        ),
    ];
    for (name, value) in optional {
        if let Some(v) = value {
            attrs.push(KeyValue::new(name, v.to_string()));
        }
    }
    attrs
}

/// A trace id as 32 lower-case hex digits, made on the stack (the access log's `trace_id`).
#[derive(Clone, Copy)]
pub struct TraceHex([u8; 32]);

impl TraceHex {
    fn new(id: opentelemetry::trace::TraceId) -> TraceHex {
        let mut digits = [b'0'; 32];
        // 16 bytes are exactly 32 digits: cannot fail.
        let _ = hex::encode_to_slice(id.to_bytes(), &mut digits);
        TraceHex(digits)
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or("")
    }

    /// The trace a request's `traceparent` names (version `00`; an invalid or all-zero one
    /// names none). A job's request names its submission's span ([`RequestTrace::job_request`]):
    /// its run's access-log line names the trace the submission's does.
    pub fn of_traceparent(value: &[u8]) -> Option<TraceHex> {
        let value = std::str::from_utf8(value).ok()?;
        let parent = opentelemetry_sdk::propagation::TraceContextPropagator::new()
            .extract(&OneHeader(value));
        let cx = parent.span().span_context().clone();
        cx.is_valid().then(|| TraceHex::new(cx.trace_id()))
    }
}

/// A carrier of one `traceparent` value, to read it as the propagator reads a request's.
struct OneHeader<'a>(&'a str);

impl Extractor for OneHeader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == "traceparent").then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent"]
    }
}

/// `{method} {route}`, OpenTelemetry's HTTP server span name, with the route's path only: a
/// pattern that starts with its method (`GET /items/{id}`) was named `GET GET /items/{id}`.
fn span_name(method: &str, route: &str) -> String {
    let path = crate::route::split_pattern(route).1;
    match known_method(method) {
        Some(m) => format!("{m} {path}"),
        None => format!("HTTP {path}"),
    }
}

/// The method as OpenTelemetry's HTTP conventions name it: one of the standard ones, exactly
/// (methods are case-sensitive), else `None` (`_OTHER`, the original in
/// `http.request.method_original`), so that a client cannot make span names without bound.
fn known_method(m: &str) -> Option<&'static str> {
    const KNOWN: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    KNOWN.into_iter().find(|k| *k == m)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_span_is_named_by_its_method_and_its_routes_path() {
        assert_eq!(
            super::span_name("GET", "GET /items/{id}"),
            "GET /items/{id}"
        );
        assert_eq!(
            super::span_name("HEAD", "GET /items/{id}"),
            "HEAD /items/{id}"
        );
        assert_eq!(
            super::span_name("POST", "/reports/generate"),
            "POST /reports/generate"
        );
        assert_eq!(super::span_name("BREW", "default"), "HTTP default");
    }

    /// What the propagator reads of a `traceparent`: version 00 with only the `sampled` flag,
    /// or nothing when it is malformed.
    #[test]
    fn a_traceparent_is_read_as_w3c_has_it() {
        const T: &str = "0af7651916cd43dd8448eb211c80319c";
        const S: &str = "b7ad6b7169203331";
        let read = |v: &str| super::well_formed(v).map(std::borrow::Cow::into_owned);
        let as_00 = |flags: &str| Some(format!("00-{T}-{S}-{flags}"));
        assert_eq!(read(&format!("00-{T}-{S}-01")), as_00("01"));
        assert_eq!(read(&format!("00-{T}-{S}-00")), as_00("00"));
        assert_eq!(read(&format!("00-{T}-{S}-03")), as_00("01"));
        assert_eq!(read(&format!("00-{T}-{S}-02")), as_00("00"));
        assert_eq!(read(&format!("00-{T}-{S}-ff")), as_00("01"));
        // A later version: its first four fields, whatever follows.
        assert_eq!(read(&format!("01-{T}-{S}-01-more")), as_00("01"));
        assert_eq!(read(&format!("1f-{T}-{S}-01")), as_00("01"));
        for bad in [
            format!("00-{T}-{S}-+1"),
            format!("00-{T}-{S}-1"),
            format!("00-{T}-{S}-001"),
            format!("00-{T}-{S}-0A"),
            format!("00-{T}-{S}-01-"),
            format!("00-{T}-{S}-01-extra"),
            format!("00-{}-{S}-01", &T[1..]),
            format!("00-+{}-{S}-01", &T[1..]),
            format!("00-{T}-+{}-01", &S[1..]),
            format!("0-{T}-{S}-01"),
            format!("ff-{T}-{S}-01"),
            format!("00-{}-{S}-01", T.to_uppercase()),
            format!("00-{T}-{S}"),
            format!("00_{T}_{S}_01"),
        ] {
            assert_eq!(read(&bad), None, "{bad}");
        }
    }
}
