//! OpenTelemetry traces (DESIGN §9), against a real OTLP/HTTP receiver (`common::otlp`) that
//! decodes what the gateway exports, a real upstream that records what it was sent, and the
//! real gateway binary.

mod common;

use std::time::{Duration, Instant};

use common::otlp::{BlackHole, Collector, Received};
use common::*;

const KEY: &str = "trace-test-key-0123456789";
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_PARENT: &str = "00f067aa0ba902b7";
/// A key in no registry (401 where there is one).
const KEY_OF_NONE: &str = "nobody-0123456789";

fn body(endpoint: &str, ratio: &str) -> String {
    format!(
        "rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 1000}}\n  endpoints:\n    /reports/generate: {{cost: 20, max_in_flight: 2, queue_timeout: 2s}}\nplans:\n  pro: {{max_cost: 500, window: 60s}}\nkeys:\n  - {{id: acme-prod, sha256: \"{}\", plan: pro}}\ntracing:\n  otlp_endpoint: \"{endpoint}\"\n  service_name: tollgate-under-test\n  sample_ratio: {ratio}\n",
        sha256_hex(KEY)
    )
}

/// The upstream's record of the request that carried `X-Request-Id: id`.
fn seen_by_upstream(up: &Upstream, id: &str) -> tollgate::sample_api::Seen {
    up.api
        .seen()
        .into_iter()
        .find(|s| s.header("x-request-id") == [id])
        .unwrap_or_else(|| panic!("the upstream never saw request {id}"))
}

/// `00-<trace>-<parent>-<flags>` → its three fields.
fn traceparent(v: &str) -> (String, String, String) {
    let f: Vec<&str> = v.split('-').collect();
    assert_eq!((f.len(), f[0]), (4, "00"), "traceparent {v}");
    (f[1].into(), f[2].into(), f[3].into())
}

fn one<'a>(spans: &'a [Received], name: &str) -> &'a Received {
    let found: Vec<&Received> = spans.iter().filter(|s| s.name() == name).collect();
    assert_eq!(found.len(), 1, "spans named {name}: {spans:#?}");
    found[0]
}

/// A request with the client's sampled `traceparent` on a capped route: the gateway's server
/// span continues the client's trace under the client's span; the store decision, the queue
/// wait and the upstream call are its children; the upstream got a `traceparent` naming the
/// gateway's (server) span (same trace; DESIGN §9) and the client's `tracestate` as it came; the attributes
/// carry the route, the key's id and plan, never the key; the access log has the trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trace_is_continued_and_the_upstream_is_its_child() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(20));
    let gw = Gateway::start(&up, &body(&collector.url(), "1.0"));
    let r = client()
        .post(gw.url("/reports/generate"))
        .header("X-API-Key", KEY)
        .header("X-Request-Id", "traced-1")
        .header(
            "traceparent",
            format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"),
        )
        .header("tracestate", "vendor=opaque,other=1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let spans = collector
        .wait_trace(
            CLIENT_TRACE,
            &[
                "POST /reports/generate",
                "store decision",
                "queue wait",
                "upstream",
            ],
        )
        .await;
    assert_eq!(spans.len(), 4, "{spans:#?}");
    let server = one(&spans, "POST /reports/generate");
    assert_eq!(server.parent_id(), CLIENT_PARENT);
    assert_eq!(server.span.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(server.service, "tollgate-under-test");
    for child in ["store decision", "queue wait", "upstream"] {
        assert_eq!(one(&spans, child).parent_id(), server.span_id(), "{child}");
    }
    let upstream_span = one(&spans, "upstream");
    assert_eq!(upstream_span.span.kind, 3, "SPAN_KIND_CLIENT");
    assert_eq!(
        upstream_span.attr("http.response.status_code").as_deref(),
        Some("200")
    );

    let seen = seen_by_upstream(&up, "traced-1");
    let sent = seen.header("traceparent");
    assert_eq!(sent.len(), 1, "{:?}", seen.headers);
    let (trace, parent, flags) = traceparent(sent[0]);
    assert_eq!(trace, CLIENT_TRACE);
    assert_eq!(parent, server.span_id());
    assert_eq!(flags, "01");
    assert_eq!(seen.header("tracestate"), ["vendor=opaque,other=1"]);

    for (attr, want) in [
        ("http.route", "/reports/generate"),
        ("http.request.method", "POST"),
        ("http.response.status_code", "200"),
        ("tollgate.cost", "20"),
        ("tollgate.decision", "admitted"),
        ("tollgate.key_id", "acme-prod"),
        ("tollgate.plan", "pro"),
        ("tollgate.request_id", "traced-1"),
    ] {
        assert_eq!(server.attr(attr).as_deref(), Some(want), "{attr}");
    }
    for s in &spans {
        assert!(!s.all_values().contains(KEY), "the raw key in {s:#?}");
    }
    gw.wait_log("traced-1").await;
    let line = gw
        .access_log()
        .into_iter()
        .find(|l| l["request_id"] == "traced-1")
        .unwrap();
    assert_eq!(line["trace_id"], CLIENT_TRACE);
}

/// `sample_ratio: 0`: a request without a parent starts a trace that is not recorded (the
/// upstream still learns it, unsampled) and exports nothing; a sampled parent is followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratio_zero_exports_nothing_new_but_follows_a_sampled_parent() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(1));
    let gw = Gateway::start(&up, &body(&collector.url(), "0"));
    let c = client();
    let r = c
        .get(gw.url("/items/1"))
        .header("X-API-Key", KEY)
        .header("X-Request-Id", "unsampled-1")
        .header("tracestate", "vendor=orphan")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = seen_by_upstream(&up, "unsampled-1");
    let (fresh, _, flags) = traceparent(seen.header("traceparent")[0]);
    assert_eq!(flags, "00");
    assert_ne!(fresh, "0".repeat(32));
    // A tracestate without a (valid) traceparent belongs to no parent: not passed on.
    assert!(seen.header("tracestate").is_empty(), "{:?}", seen.headers);
    // Its spans have ended (the access-log line is written after them).
    gw.wait_log("unsampled-1").await;

    let r = c
        .get(gw.url("/items/2"))
        .header("X-API-Key", KEY)
        .header(
            "traceparent",
            format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    collector
        .wait_trace(CLIENT_TRACE, &["GET default", "store decision", "upstream"])
        .await;
    // Spans are exported in the order they ended: the first request's would be here by now.
    let others: Vec<Received> = collector
        .spans()
        .into_iter()
        .filter(|s| s.trace_id() != CLIENT_TRACE)
        .collect();
    assert!(others.is_empty(), "{others:#?}");
    let line = gw
        .access_log()
        .into_iter()
        .find(|l| l["request_id"] == "unsampled-1")
        .unwrap();
    assert_eq!(line["trace_id"], fresh.as_str());

    // A method outside HTTP's standard ones does not name spans (OpenTelemetry's `_OTHER`).
    let other = "55555555555555555555555555555555";
    let r = c
        .request(
            reqwest::Method::from_bytes(b"FROB").unwrap(),
            gw.url("/items/3"),
        )
        .header("X-API-Key", KEY)
        .header("traceparent", format!("00-{other}-{CLIENT_PARENT}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let spans = collector.wait_trace(other, &["HTTP default"]).await;
    let server = one(&spans, "HTTP default");
    assert_eq!(
        server.attr("http.request.method").as_deref(),
        Some("_OTHER")
    );
    assert_eq!(
        server.attr("http.request.method_original").as_deref(),
        Some("FROB")
    );

    // A sampled parent whose flags also carry Level 2's `random` bit (`03`, as newer SDKs
    // send) is a sampled parent: followed, its tracestate passed on. (Before, the SDK's
    // propagator refused flags above 02, and a new, unsampled trace began.)
    let random = "66666666666666666666666666666666";
    let r = c
        .get(gw.url("/items/4"))
        .header("X-API-Key", KEY)
        .header("X-Request-Id", "random-flag")
        .header("traceparent", format!("00-{random}-{CLIENT_PARENT}-03"))
        .header("tracestate", "vendor=kept")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = seen_by_upstream(&up, "random-flag");
    let (trace, _, flags) = traceparent(seen.header("traceparent")[0]);
    assert_eq!((trace.as_str(), flags.as_str()), (random, "01"));
    assert_eq!(seen.header("tracestate"), vec!["vendor=kept"]);
    collector.wait_trace(random, &["GET default"]).await;

    // A malformed one (a sign in the flags, which the SDK's parser takes) is no parent: a new
    // trace, unsampled at this ratio, its tracestate dropped.
    let bad = "77777777777777777777777777777777";
    let r = c
        .get(gw.url("/items/5"))
        .header("X-API-Key", KEY)
        .header("X-Request-Id", "malformed")
        .header("traceparent", format!("00-{bad}-{CLIENT_PARENT}-+1"))
        .header("tracestate", "vendor=dropped")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = seen_by_upstream(&up, "malformed");
    let (trace, _, flags) = traceparent(seen.header("traceparent")[0]);
    assert_ne!(trace, bad);
    assert_eq!(flags, "00");
    assert!(seen.header("tracestate").is_empty(), "{:?}", seen.headers);
}

/// An unsampled parent (`traceparent` flags `00`) is continued — same trace, the client's span
/// as parent — but does not decide the sampling: a request without a *sampled* parent is
/// recorded at `sample_ratio` (DESIGN §1, §9). At 1.0 it is exported and the upstream learns
/// it sampled; at 0 it stays unsampled and nothing is exported. (Before, an unsampled parent
/// was never recorded, whatever the ratio.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_parent_is_continued_and_sampled_at_the_ratio() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(1));
    let all = Gateway::start(&up, &body(&collector.url(), "1.0"));
    let none = Gateway::start(&up, &body(&collector.url(), "0"));
    let c = client();
    let send = |gw: &Gateway, id: &str, trace: &str| {
        c.get(gw.url("/items/1"))
            .header("X-API-Key", KEY)
            .header("X-Request-Id", id)
            .header("traceparent", format!("00-{trace}-{CLIENT_PARENT}-00"))
            .send()
    };
    let recorded = "88888888888888888888888888888888";
    assert_eq!(
        send(&all, "unsampled-at-1", recorded)
            .await
            .unwrap()
            .status(),
        200
    );
    let spans = collector
        .wait_trace(recorded, &["GET default", "store decision", "upstream"])
        .await;
    let server = one(&spans, "GET default");
    assert_eq!(server.parent_id(), CLIENT_PARENT);
    let seen = seen_by_upstream(&up, "unsampled-at-1");
    let (trace, parent, flags) = traceparent(seen.header("traceparent")[0]);
    assert_eq!(trace, recorded);
    assert_eq!(parent, server.span_id());
    assert_eq!(flags, "01");

    let unrecorded = "99999999999999999999999999999999";
    assert_eq!(
        send(&none, "unsampled-at-0", unrecorded)
            .await
            .unwrap()
            .status(),
        200
    );
    let seen = seen_by_upstream(&up, "unsampled-at-0");
    let (trace, _, flags) = traceparent(seen.header("traceparent")[0]);
    assert_eq!((trace.as_str(), flags.as_str()), (unrecorded, "00"));
    none.wait_log("unsampled-at-0").await;
    // Its spans ended before its access-log line; the next, sampled one is exported after
    // them: had they been recorded, they would be here by then.
    let sampled = "abababababababababababababababab";
    let r = c
        .get(none.url("/items/2"))
        .header("X-API-Key", KEY)
        .header("traceparent", format!("00-{sampled}-{CLIENT_PARENT}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    collector.wait_trace(sampled, &["GET default"]).await;
    let leaked: Vec<Received> = collector
        .spans()
        .into_iter()
        .filter(|s| s.trace_id() == unrecorded)
        .collect();
    assert!(leaked.is_empty(), "{leaked:#?}");
}

/// Requests that never reach the upstream, or wait first, are spans too: a refusal (429: its
/// decision and the store's, no upstream span), a request held by `max_delay` (its hold is a
/// child span), and an unreachable upstream (502 refunded: an error status, the error type).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_holds_and_failures_are_traced() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(1));
    let dead = free_port();
    let gw = Gateway::start(
        &up,
        &format!(
            "upstreams:\n  dead: {{url: \"http://127.0.0.1:{dead}\"}}\nrate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 1000}}\n  endpoints:\n    /held: {{cost: 5}}\n    /down: {{upstream: dead}}\nplans:\n  tiny: {{max_cost: 5, window: 60s}}\n  tight: {{max_cost: 10, window: 4s, max_delay: 3s}}\nkeys:\n  - {{id: tiny-key, sha256: \"{}\", plan: tiny}}\n  - {{id: tight-key, sha256: \"{}\", plan: tight}}\ntracing:\n  otlp_endpoint: \"{}\"\n",
            sha256_hex("tiny-0123456789"),
            sha256_hex("tight-0123456789"),
            collector.url()
        ),
    );
    let c = client();
    let send = |path: &str, key: &str, trace: &str| {
        c.get(gw.url(path))
            .header("X-API-Key", key)
            .header("traceparent", format!("00-{trace}-{CLIENT_PARENT}-01"))
            .send()
    };
    let refused = "11111111111111111111111111111111";
    assert_eq!(
        send("/held", "tiny-0123456789", &"a".repeat(32))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        send("/held", "tiny-0123456789", refused)
            .await
            .unwrap()
            .status(),
        429
    );
    let spans = collector
        .wait_trace(refused, &["GET /held", "store decision"])
        .await;
    assert_eq!(spans.len(), 2, "no upstream span: {spans:#?}");
    let server = one(&spans, "GET /held");
    assert_eq!(server.attr("tollgate.decision").as_deref(), Some("budget"));
    assert_eq!(
        server.attr("http.response.status_code").as_deref(),
        Some("429")
    );
    assert_eq!(server.attr("tollgate.cost").as_deref(), Some("0"));

    // 10 units per 4 s: the third request of cost 5 waits for 5 units (2 s), within max_delay.
    let held = "22222222222222222222222222222222";
    for trace in ["2a", "2b"] {
        let t = format!("{trace:0<32}");
        assert_eq!(
            send("/held", "tight-0123456789", &t)
                .await
                .unwrap()
                .status(),
            200
        );
    }
    assert_eq!(
        send("/held", "tight-0123456789", held)
            .await
            .unwrap()
            .status(),
        200
    );
    let spans = collector
        .wait_trace(
            held,
            &["GET /held", "store decision", "max_delay hold", "upstream"],
        )
        .await;
    let server = one(&spans, "GET /held");
    let hold = one(&spans, "max_delay hold");
    assert_eq!(hold.parent_id(), server.span_id());
    let hold_ns = hold.span.end_time_unix_nano - hold.span.start_time_unix_nano;
    assert!(hold_ns > 0, "{hold:#?}");
    // The upstream was called after the hold.
    assert!(one(&spans, "upstream").span.start_time_unix_nano >= hold.span.end_time_unix_nano);

    let failed = "33333333333333333333333333333333";
    assert_eq!(
        send("/down", KEY_OF_NONE, failed).await.unwrap().status(),
        401
    );
    assert_eq!(
        send("/down", "tight-0123456789", failed)
            .await
            .unwrap()
            .status(),
        502
    );
    let spans = collector
        .wait_trace(failed, &["GET /down", "GET /down", "store decision"])
        .await;
    let down: Vec<&Received> = spans.iter().filter(|s| s.name() == "GET /down").collect();
    assert_eq!(down.len(), 2, "{spans:#?}");
    let (unauth, refunded) = if down[0].attr("tollgate.decision").as_deref() == Some("refunded") {
        (down[1], down[0])
    } else {
        (down[0], down[1])
    };
    assert_eq!(
        unauth.attr("tollgate.decision").as_deref(),
        Some("unauthenticated")
    );
    assert_eq!(unauth.attr("tollgate.key_id"), None);
    assert_eq!(
        refunded.attr("tollgate.decision").as_deref(),
        Some("refunded")
    );
    assert_eq!(
        refunded.attr("http.response.status_code").as_deref(),
        Some("502")
    );
    assert_eq!(
        refunded.span.status.as_ref().map(|s| s.code),
        Some(2),
        "STATUS_CODE_ERROR"
    );
    assert_eq!(
        refunded.attr("error.type").as_deref(),
        Some("ConnectRefused")
    );
    // No connection, no upstream call.
    assert!(spans.iter().all(|s| s.name() != "upstream"), "{spans:#?}");
}

/// A capped route's request held for its `max_delay` turn waits in the queue after the hold
/// (`crate::hold`), and its spans say so: `max_delay hold`, then `queue wait`, then the
/// upstream. The second of two requests on a cap of 1, whose provider budget gives one call
/// a second, is held ~1 s, then queued behind the first (1.5 s at the upstream). Its spans
/// were laid out queue first: a wait in a queue that was empty then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_capped_requests_spans_hold_then_queue() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            "rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 1000}}\n  endpoints:\n    /capheld:\n      cost: 1\n      max_in_flight: 1\n      queue_timeout: 10s\n      shared: {{max_cost: 1, window: 1s, max_delay: 10s}}\ntracing:\n  otlp_endpoint: \"{}\"\n",
            collector.url()
        ),
    );
    let c = client();
    let send = |path: &str, trace: &str| {
        c.get(gw.url(path))
            .header("X-API-Key", "k")
            .header("traceparent", format!("00-{trace}-{CLIENT_PARENT}-01"))
            .send()
    };
    let first = send("/capheld?delay_ms=1500", &"e".repeat(32));
    let first = tokio::spawn(first);
    up.wait_current("/capheld", 1).await;
    let second = "f".repeat(32);
    assert_eq!(send("/capheld", &second).await.unwrap().status(), 200);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    let spans = collector
        .wait_trace(
            &second,
            &[
                "GET /capheld",
                "store decision",
                "max_delay hold",
                "queue wait",
                "upstream",
            ],
        )
        .await;
    let (hold, queue) = (one(&spans, "max_delay hold"), one(&spans, "queue wait"));
    let length = |s: &Received| s.span.end_time_unix_nano - s.span.start_time_unix_nano;
    assert!(length(hold) > 500_000_000, "{hold:#?}");
    assert!(length(queue) > 0, "{queue:#?}");
    assert_eq!(
        queue.span.start_time_unix_nano,
        hold.span.end_time_unix_nano
    );
    assert!(one(&spans, "upstream").span.start_time_unix_nano >= queue.span.end_time_unix_nano);
}

/// `sample_ratio` is reloaded: from 0 (a request without a parent is not recorded) to 1 (the
/// next one is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_sample_ratio() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(1));
    let gw = Gateway::start(&up, &body(&collector.url(), "0"));
    let c = client();
    let trace_of = |id: &'static str| {
        let c = c.clone();
        let url = gw.url("/items/1");
        async move {
            let r = c
                .get(url)
                .header("X-API-Key", KEY)
                .header("X-Request-Id", id)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    trace_of("before-reload").await;
    gw.edit_config("sample_ratio: 0\n", "sample_ratio: 1\n");
    gw.signal("HUP");
    gw.wait_log("tracing.sample_ratio changed").await;
    trace_of("after-reload").await;
    gw.wait_log("after-reload").await;
    let ids: Vec<String> = ["before-reload", "after-reload"]
        .iter()
        .map(|id| {
            gw.access_log()
                .into_iter()
                .find(|l| l["request_id"] == *id)
                .unwrap()["trace_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    collector.wait_trace(&ids[1], &["GET default"]).await;
    // Exported in the order they ended: the first one's spans would be here by now.
    assert!(
        collector.spans().iter().all(|s| s.trace_id() != ids[0]),
        "{:#?}",
        collector.spans()
    );
}

/// `n` requests, 4 at a time: (every status, the slowest, the whole time).
async fn load(gw: &Gateway, n: usize) -> (Vec<u16>, Duration, Duration) {
    let c = client();
    let start = Instant::now();
    let mut statuses = vec![];
    let mut slowest = Duration::ZERO;
    for _ in 0..n / 4 {
        let t = Instant::now();
        let rs = all_at_once(4, |i| {
            c.get(gw.url(&format!("/items/{i}")))
                .header("X-API-Key", KEY)
        })
        .await;
        slowest = slowest.max(t.elapsed());
        statuses.extend(rs.iter().map(|r| r.status().as_u16()));
    }
    (statuses, slowest, start.elapsed())
}

/// A collector on a closed port, and one that accepts and never answers: every request is
/// answered, no slower than without tracing (a generous bound: the export timeout is 5 s,
/// and a request that waited for an export would take that long), and every span of every
/// request (3: server, store decision, upstream) is counted as dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_costs_spans_never_requests() {
    const N: usize = 40;
    let up = Upstream::start(Duration::from_millis(1));
    let plain = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 1000}\n",
    );
    // The same key through the untraced gateway (its default budget; it has no registry).
    let (statuses, _, _) = load(&plain, 4).await;
    assert_eq!(statuses, vec![200; 4]);
    let (statuses, base_slowest, base_total) = load(&plain, N).await;
    assert_eq!(statuses, vec![200; N]);

    let hole = BlackHole::start();
    let closed = format!("http://127.0.0.1:{}", free_port());
    for endpoint in [closed, hole.url()] {
        let gw = Gateway::start(&up, &body(&endpoint, "1.0"));
        let (statuses, slowest, total) = load(&gw, N).await;
        assert_eq!(statuses, vec![200; N], "{endpoint}");
        assert!(
            slowest < base_slowest * 4 + Duration::from_secs(1),
            "{endpoint}: slowest batch {slowest:?}, without tracing {base_slowest:?}"
        );
        assert!(
            total < base_total * 4 + Duration::from_secs(2),
            "{endpoint}: {total:?} for {N}, without tracing {base_total:?}"
        );
        wait_metric(
            &gw,
            "tollgate_trace_spans_dropped_total",
            (3 * N) as f64,
            Duration::from_secs(40),
        )
        .await;
        assert_eq!(gw.wait_access(N, |l| l["status"] == 200).await.len(), N);
    }
}

/// A job's spans: its submission's, its run's and its upstream call's.
const JOB_SPANS: [&str; 5] = [
    "POST /reports/generate",
    "store decision",
    "queue wait",
    "job /reports/generate",
    "upstream",
];

/// `body` with `/reports/generate` async (`Prefer: respond-async`), on `store` (YAML, or "").
fn job_body(endpoint: &str, store: &str) -> String {
    let b = body(endpoint, "1.0").replace(
        "queue_timeout: 2s}",
        "queue_timeout: 2s, async: {when: prefer}}",
    );
    assert!(b.contains("async:"));
    format!("{store}{b}")
}

/// Submits a job on `gws[0]` with `headers` and polls it on the last gateway until its 200;
/// returns its location.
async fn job_done(gws: &[Gateway], headers: &[(&str, &str)]) -> String {
    let c = client();
    let accepted = post_async(&c, gws[0].url("/reports/generate"), KEY, "", headers).await;
    assert_eq!(accepted.status(), 202);
    let location = job_location(&accepted);
    let last = &gws[gws.len() - 1];
    let done = job_result(&c, last, &location, KEY, Duration::from_secs(10), |_| {}).await;
    assert_eq!(done.status(), 200);
    location
}

/// Submits a job on `gws[0]` with the client's sampled `traceparent` (trace `trace`) and reads
/// its result on the last gateway; returns the trace's spans: the submission's server span, the
/// run's span under it, and the upstream call's under that, which the upstream's
/// `traceparent` names (not the client's span, which the kept request carried before).
async fn a_job_is_traced(
    up: &Upstream,
    gws: &[Gateway],
    collector: &Collector,
    trace: &str,
    rid: &str,
) {
    let location = job_done(
        gws,
        &[
            ("X-Request-Id", rid),
            ("traceparent", &format!("00-{trace}-{CLIENT_PARENT}-01")),
            ("tracestate", "vendor=opaque"),
        ],
    )
    .await;

    let spans = collector.wait_trace(trace, &JOB_SPANS).await;
    let server = one(&spans, "POST /reports/generate");
    assert_eq!(server.parent_id(), CLIENT_PARENT);
    assert_eq!(
        server.attr("http.response.status_code").as_deref(),
        Some("202")
    );
    let run = one(&spans, "job /reports/generate");
    assert_eq!(run.parent_id(), server.span_id());
    assert_eq!(run.span.kind, 5, "SPAN_KIND_CONSUMER");
    assert_eq!(
        run.attr("http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(run.attr("http.route").as_deref(), Some("/reports/generate"));
    let id = location.trim_start_matches("/_tollgate/jobs/");
    assert_eq!(run.attr("tollgate.job_id").as_deref(), Some(id));
    // The submission's store decision is its child, as a request's (it had none); the
    // job's wait for its slot is the run's first child, from the run's start.
    let store = one(&spans, "store decision");
    assert_eq!(store.parent_id(), server.span_id());
    let run_waits: Vec<&Received> = spans
        .iter()
        .filter(|s| s.name() == "queue wait" && s.parent_id() == run.span_id())
        .collect();
    assert_eq!(run_waits.len(), 1, "{spans:#?}");
    assert_eq!(
        run_waits[0].span.start_time_unix_nano,
        run.span.start_time_unix_nano
    );
    let call = one(&spans, "upstream");
    assert_eq!(call.parent_id(), run.span_id());
    assert!(call.span.start_time_unix_nano >= run_waits[0].span.end_time_unix_nano);
    assert_eq!(call.span.kind, 3, "SPAN_KIND_CLIENT");
    assert_eq!(
        call.attr("http.response.status_code").as_deref(),
        Some("200")
    );

    let seen = seen_by_upstream(up, rid);
    let sent = seen.header("traceparent");
    assert_eq!(sent.len(), 1, "{:?}", seen.headers);
    assert_eq!(
        traceparent(sent[0]),
        (trace.to_string(), run.span_id(), "01".to_string())
    );
    assert_eq!(seen.header("tracestate"), ["vendor=opaque"]);
    for s in &spans {
        assert!(!s.all_values().contains(KEY), "the raw key in {s:#?}");
    }
    // Both of the job's access-log lines name its trace (DESIGN §5), its run's too, on
    // whichever gateway ran it: the run's had none.
    let lines = eventually(Duration::from_secs(10), async || {
        let lines: Vec<serde_json::Value> = (gws.iter())
            .flat_map(|g| g.access_log())
            .filter(|l| l["request_id"] == rid)
            .collect();
        match lines.iter().any(|l| l["decision"] == "job_done") {
            true => Ok(lines),
            false => Err(format!("no job_done line for {rid} in {lines:?}")),
        }
    })
    .await;
    for l in &lines {
        assert_eq!(l["trace_id"], trace, "{l}");
    }
    assert_eq!(lines.len(), 2, "{lines:?}");
}

/// DESIGN §8–9 on the memory store: the job's run and its upstream call are spans of the
/// submission's trace. Without a client `traceparent` the submission starts the trace, and the
/// upstream's `traceparent` is in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_run_is_traced_under_its_submission() {
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(20));
    let gw = Gateway::start(&up, &job_body(&collector.url(), ""));
    let gws = [gw];
    a_job_is_traced(&up, &gws, &collector, CLIENT_TRACE, "job-traced-1").await;

    job_done(&gws, &[("X-Request-Id", "job-traced-2")]).await;
    let seen = seen_by_upstream(&up, "job-traced-2");
    let (trace, parent, flags) = traceparent(seen.header("traceparent")[0]);
    assert_eq!(flags, "01");
    let spans = collector.wait_trace(&trace, &JOB_SPANS).await;
    assert_eq!(one(&spans, "job /reports/generate").span_id(), parent);
    assert_eq!(one(&spans, "POST /reports/generate").parent_id(), "");
}

/// The same through two gateways on Redis: the job is submitted on one and its result read
/// on the other; whichever runs it traces the run under the submission's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_jobs_run_is_traced_under_its_submission() {
    let redis = Redis::start();
    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(20));
    let store = format!("store:\n  backend: redis\n  url: \"{}\"\n", redis.url());
    let body = job_body(&collector.url(), &store);
    let gws: Vec<Gateway> = (0..2).map(|_| Gateway::start(&up, &body)).collect();
    a_job_is_traced(
        &up,
        &gws,
        &collector,
        "5bf92f3577b34da6a3ce929d0e0e4737",
        "job-traced-3",
    )
    .await;
}

/// Without `tracing:`, a client's trace context goes upstream untouched and the access log
/// has no trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tracing_the_trace_context_passes_through() {
    let up = Upstream::start(Duration::from_millis(1));
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 1000}\n",
    );
    let sent = format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01");
    let r = client()
        .get(gw.url("/items/1"))
        .header("X-API-Key", KEY)
        .header("X-Request-Id", "untraced-1")
        .header("traceparent", &sent)
        .header("tracestate", "vendor=opaque")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = seen_by_upstream(&up, "untraced-1");
    assert_eq!(seen.header("traceparent"), [sent.as_str()]);
    assert_eq!(seen.header("tracestate"), ["vendor=opaque"]);
    gw.wait_log("untraced-1").await;
    let line = gw
        .access_log()
        .into_iter()
        .find(|l| l["request_id"] == "untraced-1")
        .unwrap();
    assert!(line.get("trace_id").is_none(), "{line}");
}

/// `tollgate check` names each bad `tracing:` field; a good block is shown by `check` and
/// in `/admin/config`; a reload that changes its endpoint or service name says each takes
/// effect on restart only and keeps the running values (in `/admin/config` too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tracing_block_is_checked_and_shown() {
    let out = check_fails(
        "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 10}\ntracing:\n  otlp_endpoint: \"udp://collector:4318\"\n  sample_ratio: 1.5\n  colour: blue\n",
    );
    for want in [
        "tracing.colour: unknown field `colour`",
        "tracing.sample_ratio: must be between 0 and 1, got 1.5",
        "tracing.otlp_endpoint: must start with http://",
    ] {
        assert!(out.contains(want), "{want} not in:\n{out}");
    }
    let out = check_fails(
        "upstream: {url: \"http://127.0.0.1:3000\"}\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 10}\ntracing:\n  otlp_endpoint: \"http://user:hunter2@collector:4318\"\n",
    );
    assert!(out.contains("tracing.otlp_endpoint: credentials"), "{out}");
    assert!(!out.contains("hunter2"), "{out}");

    let collector = Collector::start();
    let up = Upstream::start(Duration::from_millis(1));
    let gw = Gateway::start(&up, &body(&collector.url(), "0.25"));
    let out = cli_ok(&gw.config_path, &["check"]);
    let url = format!("{}/v1/traces", collector.url());
    assert!(
        out.contains(&format!(
            "tracing: OTLP/HTTP to {url}  service: tollgate-under-test  sample_ratio: 0.25"
        )),
        "{out}"
    );
    let config = admin_text(&gw, "/admin/config").await;
    assert!(
        config.contains(&format!("otlp_endpoint: {}", collector.url()))
            && config.contains("sample_ratio: 0.25"),
        "{config}"
    );
    // A reload that renames the service and moves the collector keeps both (restart only),
    // says so for each, and `/admin/config` shows the running values; the ratio is taken.
    gw.edit_config("tollgate-under-test", "renamed");
    gw.edit_config(&collector.url(), "http://127.0.0.1:9");
    gw.edit_config("sample_ratio: 0.25", "sample_ratio: 0.5");
    gw.signal("HUP");
    for field in ["tracing.otlp_endpoint", "tracing.service_name"] {
        gw.wait_log(&format!(
            "{field} takes effect on restart only; keeping the running value"
        ))
        .await;
    }
    let config = admin_text(&gw, "/admin/config").await;
    assert!(
        config.contains(&format!("otlp_endpoint: {}", collector.url()))
            && config.contains("service_name: tollgate-under-test")
            && config.contains("sample_ratio: 0.5")
            && !config.contains("renamed"),
        "{config}"
    );
}
