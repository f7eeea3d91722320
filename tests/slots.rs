//! Slots follow the upstream's work, not the client's connection (DESIGN §3): a request the
//! upstream received stays charged, and a capped slot stays taken until the upstream's late
//! answer ends (at most `upstream.abandon_timeout` after the request was sent).

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;

/// A 1,000-a-day budget (under a unit of refill in a test's minutes), `endpoints` (lines under
/// `endpoints:`), and the keys `a` and `b` in the registry so that their budgets can be read.
fn with_keys(endpoints: &str) -> String {
    format!(
        "rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n{endpoints}keys:\n  - {{id: a, sha256: \"{}\"}}\n  - {{id: b, sha256: \"{}\"}}\n",
        sha256_hex("key-a"),
        sha256_hex("key-b"),
    )
}

/// [`with_keys`] with a cost-10 route capped at 2 with no queue.
fn capped(extra_route: &str) -> String {
    with_keys(&format!(
        "    /reports/generate:\n      cost: 10\n      max_in_flight: 2\n{extra_route}"
    ))
}

/// Sends quick reports of key `b` until one is admitted (200), for at most `within`; returns
/// when.
async fn first_admitted(gw: &Gateway, within: Duration) -> Option<Instant> {
    let c = client();
    let start = Instant::now();
    while start.elapsed() < within {
        let r = post(&c, gw.url("/reports/generate?delay_ms=0"), "key-b").await;
        match r.status().as_u16() {
            200 => return Some(Instant::now()),
            503 => tokio::time::sleep(Duration::from_millis(50)).await,
            s => panic!("unexpected {s}"),
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_504_stays_charged_and_its_slot_follows_the_late_answer() {
    // Reports take 3 s; the gateway gives up on them after 1 s.
    let up = Upstream::start(Duration::from_secs(3));
    let body = capped("");
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        upstream_extra: "  read_timeout: 1s\n",
        ..GatewayOpts::default()
    });
    let c = client();
    let sent = Instant::now();
    let rs = all_at_once(2, |_| {
        c.post(gw.url("/reports/generate"))
            .header("X-API-Key", "key-a")
    })
    .await;
    assert_eq!(sorted_statuses(&rs), vec![504, 504]);
    for r in &rs {
        assert_eq!(header(r, "X-RateLimit-Cost").as_deref(), Some("10"));
    }
    // The upstream ran both: both are charged.
    assert_eq!(remaining(&gw, "a").await, 980);
    // The upstream is still working on both: the route is full until their answers end.
    assert_eq!(up.stats()["/reports/generate"].current, 2);
    let r = post(&c, gw.url("/reports/generate?delay_ms=0"), "key-b").await;
    assert_eq!(r.status(), 503, "the late requests still hold the slots");
    // The slots come back once the late answers are in (3 s after they were sent).
    let admitted = first_admitted(&gw, Duration::from_secs(10))
        .await
        .expect("a slot came back");
    let after = admitted - sent;
    assert!(
        after >= Duration::from_millis(2900) && after < Duration::from_secs(8),
        "{after:?}"
    );
    assert_eq!(up.max_concurrent("/reports/generate"), 2);
    assert_eq!(up.count("/reports/generate"), 3);
}

/// DESIGN §6: "a query that ran 30 s pays for 30 s", and the backend's stated cost is the
/// final charge: on a capped route a 504's charge follows the late answer as its slot does
/// (as a job's does). Before, it was fixed at `read_timeout`: the 3 s query paid for 1 s, and
/// the stated 60 was never applied nor counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_504s_charge_is_settled_on_the_late_answer() {
    let up = Upstream::start(Duration::ZERO);
    let body = with_keys(
        "    /cps: {cost: 2, cost_per_second: 10, max_in_flight: 2}\n    /cfr: {cost: 10, cost_from_response: X-Actual-Cost, max_in_flight: 2}\n",
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        upstream_extra: "  read_timeout: 1s\n",
        ..GatewayOpts::default()
    });
    let c = client();
    let r = get(&c, gw.url("/cps?delay_ms=3000"), "key-a").await;
    assert_eq!(r.status(), 504);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("2"));
    let r = get(&c, gw.url("/cfr?delay_ms=2000&actual_cost=60"), "key-b").await;
    assert_eq!(r.status(), 504);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("10"));
    // Settled once the late answers are in: 10 a second for the upstream's 3 s at least (31
    // on a fast machine), and the stated 60.
    wait_metric_at_least(&gw, r#"tollgate_cost_units_total{route="/cps"}"#, 31.0).await;
    wait_metric(
        &gw,
        r#"tollgate_cost_reports_total{result="applied",route="/cfr"}"#,
        1.0,
        Duration::from_secs(10),
    )
    .await;
    let cps = metric(&gw, r#"tollgate_cost_units_total{route="/cps"}"#).await as u64;
    assert!((31..=40).contains(&cps), "{cps}");
    assert_eq!(remaining(&gw, "a").await, 1000 - cps);
    assert_metric(&gw, r#"tollgate_cost_units_total{route="/cfr"}"#, 60.0).await;
    assert_eq!(remaining(&gw, "b").await, 940);
    // The 504's upstream time is observed once, as it was billed: to the late answer's head.
    assert_metric(
        &gw,
        r#"tollgate_upstream_duration_seconds_count{route="/cps"}"#,
        1.0,
    )
    .await;
    let sum = metric(
        &gw,
        r#"tollgate_upstream_duration_seconds_sum{route="/cps"}"#,
    )
    .await;
    assert!((3.0..6.0).contains(&sum), "{sum}");
}

/// A late answer that never comes is billed the time the gateway followed the upstream for
/// it: to `abandon_timeout` here (3 s at 10 a second: 30 and a little), as long as the slot
/// was held. Before, it paid as at `read_timeout` (1 s: 11), though the upstream worked on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_answer_that_never_comes_is_billed_until_abandon_timeout() {
    let up = Upstream::start(Duration::ZERO);
    let body = with_keys(
        "    /cps: {cost: 2, cost_per_second: 10, max_in_flight: 2}
",
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        upstream_extra: "  read_timeout: 1s\n  abandon_timeout: 3s\n",
        ..GatewayOpts::default()
    });
    let c = client();
    let r = get(&c, gw.url("/cps?delay_ms=10000"), "key-a").await;
    assert_eq!(r.status(), 504);
    wait_metric_at_least(&gw, r#"tollgate_cost_units_total{route="/cps"}"#, 30.0).await;
    let cps = metric(&gw, r#"tollgate_cost_units_total{route="/cps"}"#).await as u64;
    assert!((30..=40).contains(&cps), "{cps}");
    assert_eq!(remaining(&gw, "a").await, 1000 - cps);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_answer_is_followed_for_abandon_timeout_at_most() {
    let up = Upstream::start(Duration::ZERO);
    let body = capped("");
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        upstream_extra: "  read_timeout: 500ms\n  abandon_timeout: 2s\n",
        ..GatewayOpts::default()
    });
    let c = client();
    let sent = Instant::now();
    // Both slots taken by reports that take 30 s.
    let rs = all_at_once(2, |_| {
        c.post(gw.url("/reports/generate?delay_ms=30000"))
            .header("X-API-Key", "key-a")
    })
    .await;
    assert_eq!(sorted_statuses(&rs), vec![504, 504]);
    let r = post(&c, gw.url("/reports/generate"), "key-b").await;
    assert_eq!(r.status(), 503);
    let admitted = first_admitted(&gw, Duration::from_secs(10))
        .await
        .expect("the slots were given up after abandon_timeout");
    let after = admitted - sent;
    assert!(
        after >= Duration::from_millis(1900) && after < Duration::from_secs(8),
        "{after:?}"
    );
    assert_eq!(remaining(&gw, "a").await, 980);
}

#[test]
fn abandon_timeout_shorter_than_read_timeout_is_refused() {
    let text = check_fails(
        "upstream:\n  url: \"http://127.0.0.1:1\"\n  read_timeout: 5s\n  abandon_timeout: 1s\nrate_limits:\n  default: {cost: 1, window: 1m, max_cost: 10}\n",
    );
    assert!(
        text.contains("upstream.abandon_timeout: must be at least read_timeout (5s), got 1s"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_after_admission_is_charged_and_frees_its_slot() {
    let up = Upstream::start(Duration::ZERO);
    let body = with_keys("    /upload:\n      cost: 10\n      max_in_flight: 1\n");
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        server_extra: "  body_timeout: 1s\n",
        ..GatewayOpts::default()
    });
    let mut sock = raw_connect(gw.port);
    sock.write_all(
        b"POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: key-a\r\nContent-Length: 100\r\n\r\nx",
    )
    .unwrap();
    up.wait_current("/upload", 1).await;
    // The body never comes: 408 (or a closed connection) after body_timeout.
    let answer = tokio::task::spawn_blocking(move || read_raw_response(&mut sock))
        .await
        .unwrap();
    assert!(
        answer.as_ref().is_none_or(|r| r.status == 408),
        "{answer:?}"
    );
    // The upstream had the request: charged. The slot is free again.
    assert_eq!(remaining(&gw, "a").await, 990);
    let c = client();
    let start = Instant::now();
    loop {
        let r = c
            .post(gw.url("/upload"))
            .header("X-API-Key", "key-b")
            .body("hello")
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(start.elapsed() < Duration::from_secs(5), "slot never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
