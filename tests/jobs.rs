//! Async jobs (DESIGN §8, issue 26) on the memory store: `Prefer: respond-async` gets 202 and
//! a job location; the job waits in the route's fair queue, runs once through the synchronous
//! path's upstream request, and its answer is kept for the same key for `result_ttl`. Charges
//! follow DESIGN §3 (refunded when the upstream never had it, charged when it did).

mod common;

use std::time::{Duration, Instant};

use common::*;

const ROUTE: &str = "/reports/generate";

/// Registry keys `a` and `b` (raw keys `key-a`, `key-b`), a 24 h budget of 100 (no refill
/// within a test) and `endpoints` (YAML lines under `endpoints:`).
fn config(endpoints: &str) -> String {
    let keys: String = ["a", "b"].iter().map(|id| registry_key(id, "")).collect();
    format!(
        "rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n{endpoints}keys:\n{keys}"
    )
}

/// `/reports/generate` costing 10, capped at `cap`, async with `extra` (lines under `async:`).
fn reports(cap: u32, extra: &str) -> String {
    format!(
        "    /reports/generate:\n      cost: 10\n      max_in_flight: {cap}\n      async:\n        result_ttl: 2s\n{extra}"
    )
}

/// A gateway on `body` that waits 500 ms for the upstream's answer (`read_timeout`).
fn impatient(up: &Upstream, body: &str) -> Gateway {
    Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body,
        upstream_extra: "  read_timeout: 500ms\n",
        ..GatewayOpts::default()
    })
}

/// Submits a job: the 202 and its location.
async fn submit(c: &reqwest::Client, gw: &Gateway, target: &str, key: &str, body: &str) -> String {
    let r = post_async(c, gw.url(target), key, body, &[]).await;
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    job_location(&r)
}

/// Polls `location` until the job is no longer queued or running: the final answer.
async fn result(c: &reqwest::Client, gw: &Gateway, location: &str, key: &str) -> reqwest::Response {
    job_result(c, gw, location, key, Duration::from_secs(20), |_| {}).await
}

fn series(result: &str) -> String {
    format!("tollgate_jobs_total{{result=\"{result}\",route=\"{ROUTE}\"}}")
}

/// A job whose upstream answered 204 is served as the upstream answered: no content, and no
/// `Content-Length` (RFC 9110 §8.6: none on a 204), as the synchronous answer. It said
/// `Content-Length: 0`.
#[tokio::test]
async fn a_job_answered_204_is_served_without_a_length() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(&reports(1, "")));
    let c = client();
    let sync = post(&c, gw.url("/reports/generate?status=204"), "key-a").await;
    assert_eq!(sync.status(), 204);
    assert_eq!(header(&sync, "content-length"), None);
    let location = submit(&c, &gw, "/reports/generate?status=204", "key-a", "x").await;
    let done = result(&c, &gw, &location, "key-a").await;
    assert_eq!(done.status(), 204);
    assert_eq!(header(&done, "content-length"), None);
    assert_eq!(done.bytes().await.unwrap().len(), 0);
    // Both were admitted (the job from its 202; its polls are not requests to the route):
    // `/admin/routes` counts them in the last minute. It counted the synchronous one only.
    let v = admin_json(&gw, "/admin/routes").await;
    let reports = find_route(&v, ROUTE).cloned().unwrap_or_default();
    assert_eq!(
        reports["last_minute"],
        serde_json::json!({"admitted": 2, "refused": 0}),
        "{v}"
    );
}

#[tokio::test]
async fn check_refuses_async_where_it_cannot_work() {
    let uncapped = check_fails(&format!(
        "upstream: {{url: \"http://127.0.0.1:1\"}}\n{}",
        config("    /reports/generate:\n      cost: 10\n      async: {when: always}\n")
    ));
    assert!(
        uncapped.contains("rate_limits.endpoints.\"/reports/generate\".async: only a capped endpoint (with max_in_flight) may be async"),
        "{uncapped}"
    );
    let bad = check_fails(&format!(
        "upstream: {{url: \"http://127.0.0.1:1\"}}\n{}",
        config(&reports(
            1,
            "        max_request_body: 1MB\n        when: sometimes\n"
        ))
    ));
    assert!(bad.contains("unknown size unit \"MB\""), "{bad}");
}

/// The issue's lifecycle on one gateway: 202 with the job's location, 202 while it runs, then
/// the upstream's answer as it came; the upstream saw the request once, with its method,
/// target and body; charged once, polls free, another key 404, gone after result_ttl.
#[tokio::test]
async fn a_job_runs_once_and_its_answer_is_kept_for_its_key() {
    let up = Upstream::start(Duration::from_millis(1500));
    let gw = Gateway::start(&up, &config(&reports(1, "")));
    let c = client();
    let target = "/reports/generate?echo_body=1";
    let r = c
        .post(gw.url(target))
        .header("X-API-Key", "key-a")
        .header("Prefer", "respond-async, return=minimal")
        .header("X-Request-Id", "job-test-1")
        // Hop-by-hop: what a synchronous request's upstream never sees, a job's neither; a
        // header the gateway sets itself (X-Request-Id) is sent all the same.
        .header("Connection", "X-Hop, X-Request-Id")
        .header("X-Hop", "1")
        .header("Proxy-Authorization", "Basic eA==")
        .body("the report's parameters")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(
        header(&r, "preference-applied").as_deref(),
        Some("respond-async")
    );
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("10"));
    assert!(header(&r, "retry-after").unwrap().parse::<u64>().unwrap() >= 1);
    let location = header(&r, "location").unwrap();
    let id = location
        .strip_prefix("/_tollgate/jobs/")
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 32, "{id}");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (body["id"].as_str(), body["status"].as_str()),
        (Some(&*id), Some("queued"))
    );

    // While it runs: 202, free, for its own key only.
    up.wait_current(ROUTE, 1).await;
    let running = get(&c, gw.url(&location), "key-a").await;
    assert_eq!(running.status(), 202);
    assert_eq!(header(&running, "x-ratelimit-cost").as_deref(), Some("0"));
    // DESIGN §3: every response to an identified request has every rate-limit header; a
    // poll's describe the key's budget as it stands (the submission's 10 spent).
    let full_headers = |r: &reqwest::Response| {
        assert_eq!(
            header(r, "x-ratelimit-remaining").as_deref(),
            Some("90"),
            "{r:?}"
        );
        assert!(header(r, "ratelimit")
            .unwrap()
            .starts_with("\"default\";r=90;t="));
        assert!(
            header(r, "x-ratelimit-reset")
                .unwrap()
                .parse::<u64>()
                .unwrap()
                > 0
        );
        assert_eq!(header(r, "x-ratelimit-limit").as_deref(), Some("100"));
        assert_eq!(header(r, "x-ratelimit-cost").as_deref(), Some("0"));
    };
    full_headers(&running);
    let v: serde_json::Value = running.json().await.unwrap();
    assert_eq!(v["status"], "running");
    assert_eq!(get(&c, gw.url(&location), "key-b").await.status(), 404);
    assert_eq!(c.get(gw.url(&location)).send().await.unwrap().status(), 401);
    let unknown = format!("/_tollgate/jobs/{}", "0".repeat(32));
    let not_found = get(&c, gw.url(&unknown), "key-a").await;
    assert_eq!(not_found.status(), 404);
    full_headers(&not_found);
    // Its body's members agree with its headers, as a synchronous refusal's do (§3).
    let p: serde_json::Value = not_found.json().await.unwrap();
    assert_eq!(
        (p["cost"].as_u64(), p["remaining"].as_u64()),
        (Some(0), Some(90)),
        "{p}"
    );

    let done = result(&c, &gw, &location, "key-a").await;
    assert_eq!(done.status(), 200);
    full_headers(&done);
    assert_eq!(
        header(&done, "content-type").as_deref(),
        Some("application/json")
    );
    let echo: serde_json::Value = done.json().await.unwrap();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], ROUTE);
    assert_eq!(echo["query"], "echo_body=1");
    assert_eq!(echo["body"], "the report's parameters");
    assert_eq!(echo["headers"]["x-request-id"], "job-test-1");
    assert_eq!(echo["headers"]["prefer"], "return=minimal");
    for hop in ["x-hop", "proxy-authorization", "connection"] {
        assert!(echo["headers"][hop].is_null(), "{hop}: {echo}");
    }
    // The same answer again for as long as it is kept; the upstream ran it once.
    let again = get(&c, gw.url(&location), "key-a").await;
    assert_eq!(again.status(), 200);
    assert_eq!(up.count(ROUTE), 1);
    // Other spellings of the job's path are the same poll (DESIGN §3: the route is chosen from
    // the normalized path): answered by the gateway, free, never forwarded. (reqwest resolves
    // `.` and `..` itself; the unit test of `proxy::jobs` has those.)
    for spelled in [
        format!("/_tollgate//jobs/{id}"),
        format!("/_tollgate/%6aobs/{id}"),
        format!("/_tollgate/jobs;v=1/{id}"),
        format!("/_TOLLGATE/Jobs/{id}"),
    ] {
        let r = get(&c, gw.url(&spelled), "key-a").await;
        assert_eq!(r.status(), 200, "{spelled}");
        assert_eq!(
            header(&r, "x-ratelimit-cost").as_deref(),
            Some("0"),
            "{spelled}"
        );
    }
    for none in ["/_tollgate/jobs", "/_tollgate/jobs/"] {
        assert_eq!(get(&c, gw.url(none), "key-a").await.status(), 404, "{none}");
    }
    // An absolute-form target names the same path (DESIGN §3): the same poll, never forwarded
    // (it reached the upstream as the default route).
    let (port, line) = (gw.port, format!("GET http://localhost/_tollgate/jobs/{id}"));
    let r =
        tokio::task::spawn_blocking(move || raw_request(port, &raw(&line, &["X-API-Key: key-a"])))
            .await
            .unwrap()
            .expect("an answer");
    assert_eq!((r.status, r.header("x-ratelimit-cost")), (200, Some("0")));
    let forwarded = up
        .api
        .seen()
        .iter()
        .filter(|s| s.target.contains("tollgate"))
        .count();
    assert_eq!(forwarded, 0, "a job's path reached the upstream");
    let seen = up.seen_on(ROUTE);
    assert_eq!(
        (seen.len(), seen[0].method.as_str(), seen[0].target.as_str()),
        (1, "POST", target)
    );
    // Charged once (10 of 100), polls free.
    assert_eq!(remaining(&gw, "a").await, 90);
    assert_metric(&gw, &series("done"), 1.0).await;
    assert_metric(
        &gw,
        &format!("tollgate_cost_units_total{{route=\"{ROUTE}\"}}"),
        10.0,
    )
    .await;

    // Gone after result_ttl (2 s).
    let start = Instant::now();
    while get(&c, gw.url(&location), "key-a").await.status() == 200 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the result was never forgotten"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(get(&c, gw.url(&location), "key-a").await.status(), 404);

    // One access-log line at submission and one at the end, both with the job's id.
    let lines = gw
        .wait_access(2, |l| l["job"] == *id && l["decision"] != "job_poll")
        .await;
    let decisions: Vec<_> = lines
        .iter()
        .map(|l| l["decision"].as_str().unwrap())
        .collect();
    assert_eq!(decisions, ["job_submitted", "job_done"], "{lines:?}");
    assert_eq!(
        (lines[0]["status"].as_u64(), lines[0]["cost"].as_u64()),
        (Some(202), Some(10))
    );
    assert_eq!(
        (lines[1]["status"].as_u64(), lines[1]["cost"].as_u64()),
        (Some(200), Some(10))
    );
    assert_eq!(lines[1]["request_id"], "job-test-1");
    assert!(!gw.log().contains("key-a"), "the raw key was logged");
}

/// Ten jobs of one key, then one of another, on cap 2: never more than 2 at the upstream, all
/// done, and the other key's job runs in the first wave after it was submitted.
#[tokio::test]
async fn jobs_share_a_full_route_fairly() {
    let up = Upstream::start(Duration::from_millis(1000));
    // A minute to wait: 11 reports of 1 s on 2 slots take 6 s (a job waits up to result_ttl).
    let gw = Gateway::start(
        &up,
        &config(&reports(2, "").replace("result_ttl: 2s", "result_ttl: 1m")),
    );
    let c = client();
    let mut locations = vec![];
    for _ in 0..10 {
        locations.push((submit(&c, &gw, ROUTE, "key-a", "").await, "key-a"));
    }
    up.wait_current(ROUTE, 2).await;
    locations.push((submit(&c, &gw, ROUTE, "key-b", "").await, "key-b"));
    // Started by now, key b's perhaps included: b is among the next 2 after its queueing.
    let before_b = up.count(ROUTE);
    let routes = admin_json(&gw, "/admin/routes").await;
    let r = route_entry(&routes, ROUTE).clone();
    assert_eq!(r["jobs"]["running"], 2, "{r}");
    assert!(r["jobs"]["queued"].as_u64().unwrap() >= 5, "{r}");
    // /admin/status lists them too (it said `[]` whatever ran).
    let status = admin_json(&gw, "/admin/status").await;
    let jobs = status["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{status}");
    assert_eq!(
        (jobs[0]["route"].as_str(), jobs[0]["running"].as_u64()),
        (Some(ROUTE), Some(2)),
        "{status}"
    );
    assert!(jobs[0]["queued"].as_u64().unwrap() >= 4, "{status}");
    for (location, key) in &locations {
        assert_eq!(result(&c, &gw, location, key).await.status(), 200);
    }
    assert_eq!(up.count(ROUTE), 11);
    assert_eq!(up.max_concurrent(ROUTE), 2);
    // Key b's report reached the upstream within the 2 releases after it was queued (in
    // arrival order it would have waited behind 8).
    let order = up.keys_in_order(ROUTE);
    let b_at = order.iter().position(|k| k == "key-b").unwrap() as u64;
    assert!(
        b_at < before_b + 2,
        "key b ran {b_at}th of {order:?} (queued after {before_b})"
    );
    assert_metric(&gw, &series("done"), 11.0).await;
    assert_eq!(remaining(&gw, "a").await, 0);
    assert_eq!(remaining(&gw, "b").await, 90);
}

/// DESIGN §8's `position` is the job's place in the fair order, kept up to date while it waits
/// (it was its place in arrival order: key b's one job said 3 behind key a's two).
#[tokio::test]
async fn a_jobs_position_is_its_place_in_the_fair_order() {
    let up = Upstream::start(Duration::from_millis(2500));
    let gw = Gateway::start(
        &up,
        &config(&reports(1, "").replace("result_ttl: 2s", "result_ttl: 1m")),
    );
    job_positions_follow_the_fair_order(&up, &gw, &gw, ROUTE).await;
}

/// A job beyond the route's `max_queue` is refused as the full queue it met: 503 saying so,
/// counted as `route_busy` (it was "no slot freed within 0 ms", `in_flight`), not charged.
#[tokio::test]
async fn a_job_beyond_max_queue_is_told_the_queue_is_full() {
    let up = Upstream::start(Duration::from_millis(3000));
    let endpoint = reports(1, "")
        .replace(
            "max_in_flight: 1\n",
            "max_in_flight: 1\n      max_queue: 1\n",
        )
        .replace("result_ttl: 2s", "result_ttl: 1m");
    let gw = Gateway::start(&up, &config(&endpoint));
    let c = client();
    let first = submit(&c, &gw, ROUTE, "key-a", "").await;
    up.wait_current(ROUTE, 1).await;
    let second = submit(&c, &gw, ROUTE, "key-a", "").await;
    refused_at_once_by_a_full_queue(&gw, "key-a").await;
    assert_eq!(remaining(&gw, "a").await, 80);
    for location in [&first, &second] {
        assert_eq!(result(&c, &gw, location, "key-a").await.status(), 200);
    }
}

/// DELETE takes a queued job out (refunded), and is 409 once the job runs.
#[tokio::test]
async fn cancel_refunds_a_queued_job_and_refuses_a_running_one() {
    let up = Upstream::start(Duration::from_millis(3000));
    let gw = Gateway::start(&up, &config(&reports(1, "")));
    let c = client();
    let first = submit(&c, &gw, ROUTE, "key-a", "").await;
    up.wait_current(ROUTE, 1).await;
    let second = submit(&c, &gw, ROUTE, "key-a", "").await;
    let queued: serde_json::Value = get(&c, gw.url(&second), "key-a")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (queued["status"].as_str(), queued["position"].as_u64()),
        (Some("queued"), Some(1))
    );
    assert_eq!(remaining(&gw, "a").await, 80);
    // Another key cannot cancel it.
    let other = c
        .delete(gw.url(&second))
        .header("X-API-Key", "key-b")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 404);
    let cancelled = c
        .delete(gw.url(&second))
        .header("X-API-Key", "key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    // Its headers show the refund: 90 left, nothing charged.
    assert_eq!(
        header(&cancelled, "x-ratelimit-remaining").as_deref(),
        Some("90")
    );
    assert_eq!(header(&cancelled, "x-ratelimit-cost").as_deref(), Some("0"));
    let v: serde_json::Value = cancelled.json().await.unwrap();
    assert_eq!(v["status"], "cancelled");
    assert_metric(&gw, &series("cancelled"), 1.0).await;
    assert_eq!(remaining(&gw, "a").await, 90);
    assert_eq!(get(&c, gw.url(&second), "key-a").await.status(), 404);
    // Its last access-log line: answered to nobody (its client called it off), 499 as for a
    // client that left; nothing charged. (It said status 0.)
    let id = second.rsplit('/').next().unwrap().to_string();
    let line = gw
        .wait_access(1, |l| l["job"] == *id && l["decision"] == "job_cancelled")
        .await;
    assert_eq!(
        (line[0]["status"].as_u64(), line[0]["cost"].as_u64()),
        (Some(499), Some(0))
    );
    let running = c
        .delete(gw.url(&first))
        .header("X-API-Key", "key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(running.status(), 409);
    let p: serde_json::Value = running.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("job-started"), "{p}");
    assert_eq!(p["cost"].as_u64(), Some(0), "{p}");
    assert!(p["remaining"].as_u64().is_some(), "{p}");
    assert_eq!(result(&c, &gw, &first, "key-a").await.status(), 200);
    assert_eq!(up.count(ROUTE), 1);
}

/// A body over max_request_body is 413 and charges nothing; without the preference the
/// request is synchronous; with `when: always` every request is a job; a refused budget
/// makes no job.
#[tokio::test]
async fn submission_refusals_charge_nothing_and_make_no_job() {
    let up = Upstream::start(Duration::from_millis(50));
    let endpoints = format!(
        "{}    /exports/bulk:\n      cost: 60\n      max_in_flight: 1\n      async: {{when: always}}\n",
        reports(1, "        max_request_body: 16B\n")
    );
    let gw = Gateway::start(&up, &config(&endpoints));
    let c = client();
    let r = c
        .post(gw.url(ROUTE))
        .header("X-API-Key", "key-a")
        .header("Prefer", "respond-async")
        .body("x".repeat(17))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("0"));
    // Every header of an identified request (DESIGN §3), the budget as it stands: untouched.
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("100"));
    assert_eq!(header(&r, "x-ratelimit-reset").as_deref(), Some("0"));
    assert_eq!(
        header(&r, "ratelimit").as_deref(),
        Some("\"default\";r=100;t=0")
    );
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("payload-too-large"),
        "{p}"
    );
    // Chunked, without a declared length: the same.
    let twenty = chunked(&["x".repeat(10), "y".repeat(10)]);
    let r = post_async_body(&c, gw.url(ROUTE), "key-a", twenty, &[]).await;
    assert_eq!(r.status(), 413);
    assert_eq!(remaining(&gw, "a").await, 100);
    // 16 bytes fit.
    let location = submit(&c, &gw, ROUTE, "key-a", &"x".repeat(16)).await;
    assert_eq!(result(&c, &gw, &location, "key-a").await.status(), 200);
    // No preference: an ordinary request.
    let sync = post(&c, gw.url(ROUTE), "key-a").await;
    assert_eq!(sync.status(), 200);
    assert_eq!(remaining(&gw, "a").await, 80);
    // when: always: a job without asking; then the budget refuses (20 left, cost 60): no job.
    let always = post(&c, gw.url("/exports/bulk"), "key-a").await;
    assert_eq!(always.status(), 202);
    let refused = post(&c, gw.url("/exports/bulk"), "key-a").await;
    assert_eq!(refused.status(), 429);
    // One job on the route, ever: the 429 made none.
    let bulk = |s: &str| format!("tollgate_jobs{{route=\"/exports/bulk\",state=\"{s}\"}}");
    assert_metric(
        &gw,
        "tollgate_jobs_total{result=\"done\",route=\"/exports/bulk\"}",
        1.0,
    )
    .await;
    assert_eq!(
        metric(&gw, &bulk("queued")).await + metric(&gw, &bulk("running")).await,
        0.0
    );
}

/// A gateway before `upstream_url` where key a's one job fails with a 502
/// `upstream-unavailable`.
async fn failed_job(c: &reqwest::Client, upstream_url: String) -> Gateway {
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url,
        body: &config(&reports(1, "")),
        ..GatewayOpts::default()
    });
    let job = submit(c, &gw, ROUTE, "key-a", "").await;
    let r = result(c, &gw, &job, "key-a").await;
    assert_eq!(r.status(), 502);
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"]
            .as_str()
            .unwrap()
            .ends_with("upstream-unavailable"),
        "{p}"
    );
    gw
}

/// An answer over max_response_body fails the job, charged; an upstream that is down fails
/// it refunded (502); one too slow fails it charged (504); one that hangs up after reading
/// the request fails it charged (502).
#[tokio::test]
async fn failed_jobs_are_charged_as_synchronous_requests_would_be() {
    let up = Upstream::start(Duration::from_millis(50));
    let endpoints = format!(
        "    \"/bytes/{{n}}\":\n      cost: 10\n      max_in_flight: 1\n      async: {{max_response_body: 1KiB}}\n{}",
        reports(1, "")
    );
    let gw = impatient(&up, &config(&endpoints));
    let c = client();
    let big = submit(&c, &gw, "/bytes/5000", "key-a", "").await;
    let r = result(&c, &gw, &big, "key-a").await;
    assert_eq!(r.status(), 502);
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("response-too-large"),
        "{p}"
    );
    let small = submit(&c, &gw, "/bytes/1000", "key-a", "").await;
    let r = result(&c, &gw, &small, "key-a").await;
    assert_eq!(
        (r.status().as_u16(), r.bytes().await.unwrap().len()),
        (200, 1000)
    );
    assert_eq!(remaining(&gw, "a").await, 80);

    let slow = submit(&c, &gw, "/reports/generate?delay_ms=1500", "key-a", "").await;
    let r = result(&c, &gw, &slow, "key-a").await;
    assert_eq!(r.status(), 504);
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("upstream-timeout"),
        "{p}"
    );
    assert_eq!(remaining(&gw, "a").await, 70);
    // Observed as a synchronous 504 is: its upstream time, until the timeout, in the metric
    // and its end line. (Before, in neither: `audit` saw the route cheaper than it is.)
    assert_metric(
        &gw,
        "tollgate_upstream_duration_seconds_count{route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    let failed = gw
        .wait_access(1, |l| l["decision"] == "job_failed" && l["status"] == 504)
        .await;
    let ms = failed[0]["upstream_ms"].as_f64().unwrap_or_default();
    assert!((500.0..1500.0).contains(&ms), "{}", failed[0]);
    assert_metric(&gw, &series("failed"), 1.0).await;
    assert_metric(
        &gw,
        "tollgate_jobs_total{result=\"failed\",route=\"/bytes/{n}\"}",
        1.0,
    )
    .await;
    assert_metric(
        &gw,
        "tollgate_jobs_total{result=\"done\",route=\"/bytes/{n}\"}",
        1.0,
    )
    .await;

    let down = failed_job(&c, format!("http://127.0.0.1:{}", free_port())).await;
    assert_eq!(remaining(&down, "a").await, 100);

    // One that read the request and hung up without answering had it: 502, charged, once;
    // also when it hangs up the moment it has read it (that was refunded).
    for after in [Duration::from_millis(200), Duration::ZERO] {
        let hangs_up = HangUp::start(after);
        let gw = failed_job(&c, hangs_up.url()).await;
        assert_eq!(remaining(&gw, "a").await, 90, "{after:?}");
        assert_eq!(hangs_up.seen(ROUTE).len(), 1);
    }
}

/// SIGTERM: a running job finishes within grace_period like a request (its end is logged
/// before the process exits 0); a queued one is not started by the draining instance.
#[tokio::test]
async fn sigterm_lets_a_running_job_finish_and_starts_no_queued_one() {
    let up = Upstream::start(Duration::from_millis(1500));
    let mut gw = Gateway::start_with_grace(&up, &config(&reports(1, "")), "10s");
    let c = client();
    let running = submit(&c, &gw, ROUTE, "key-a", "").await;
    up.wait_current(ROUTE, 1).await;
    let queued = submit(&c, &gw, ROUTE, "key-b", "").await;
    let id = |loc: &str| loc.rsplit('/').next().unwrap().to_string();
    gw.signal("TERM");
    assert_eq!(
        gw.wait_exit(Duration::from_secs(15)),
        Some(0),
        "{}",
        gw.log()
    );
    let ended: Vec<_> = gw
        .access_log()
        .into_iter()
        .filter(|l| l["decision"] == "job_done")
        .map(|l| l["job"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ended, [id(&running)], "{}", gw.log());
    assert_eq!(up.count(ROUTE), 1);
    assert!(
        gw.log().contains(&id(&queued)),
        "the queued job was not named"
    );
}

/// An exit past grace_period (SIGTERM), or SIGINT, while a job runs: the jobs still queued
/// behind it are not run, and the log names each (README: "it logs each job it did not run").
/// It named one only if a slot came to it while the instance drained: these were never named.
#[tokio::test]
async fn an_exit_names_the_queued_jobs_it_did_not_run() {
    for signal in ["TERM", "INT"] {
        let up = Upstream::start(Duration::ZERO);
        let mut gw = Gateway::start_with_grace(&up, &config(&reports(1, "")), "1s");
        let c = client();
        let _running = submit(&c, &gw, &format!("{ROUTE}?delay_ms=10000"), "key-a", "").await;
        up.wait_current(ROUTE, 1).await;
        let queued = submit(&c, &gw, ROUTE, "key-b", "").await;
        let id = queued.rsplit('/').next().unwrap().to_string();
        gw.signal(signal);
        assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0), "{signal}");
        let log = gw.log();
        let named = log
            .lines()
            .any(|l| l.contains("queued job not run") && l.contains(&id));
        assert!(named, "{signal}: the queued job was not named:\n{log}");
        assert_eq!(up.count(ROUTE), 1, "{signal}");
    }
}

/// A job that finds no slot within result_ttl expires: its result is a 503 route-busy, and its
/// charge comes back; it never reaches the upstream.
#[tokio::test]
async fn a_job_that_waits_past_result_ttl_expires_refunded() {
    let up = Upstream::start(Duration::from_millis(4000));
    let gw = Gateway::start(
        &up,
        &config(&reports(1, "").replace("result_ttl: 2s", "result_ttl: 1s")),
    );
    let c = client();
    let _first = submit(&c, &gw, ROUTE, "key-a", "").await;
    up.wait_current(ROUTE, 1).await;
    let second = submit(&c, &gw, ROUTE, "key-b", "").await;
    assert_eq!(remaining(&gw, "b").await, 90);
    let r = result(&c, &gw, &second, "key-b").await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("route-busy"), "{p}");
    assert_eq!(p["retry_after"].as_u64(), Some(1), "{p}");
    assert_metric(&gw, &series("expired"), 1.0).await;
    assert_eq!(remaining(&gw, "b").await, 100);
    assert_eq!(up.count(ROUTE), 1);
}

/// A submission whose body is framed wrongly (a chunk size that is not hex) is the client's
/// error, as on the synchronous path: 400, nothing charged, no job. (Before: 500.)
#[test]
fn a_malformed_async_body_is_400() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(&reports(1, "")));
    let request = b"POST /reports/generate HTTP/1.1\r\nHost: localhost\r\nX-API-Key: key-a\r\nPrefer: respond-async\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n";
    let r = raw_request(gw.port, request).expect("an answer");
    assert_eq!(r.status, 400, "{r:?}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(rt.block_on(remaining(&gw, "a")), 100);
    assert_eq!(up.count(ROUTE), 0);
}

/// A job's charge settles when it ends, as a request's does: here on the cost the upstream
/// states (`cost_from_response`), whose header the stored answer no longer carries.
#[tokio::test]
async fn a_job_settles_on_the_cost_its_upstream_states() {
    let up = Upstream::start(Duration::from_millis(50));
    let endpoints = reports(1, "").replace(
        "      async:\n",
        "      cost_from_response: X-Actual-Cost\n      async:\n",
    );
    let gw = Gateway::start(&up, &config(&endpoints));
    let c = client();
    let job = submit(&c, &gw, "/reports/generate?actual_cost=35", "key-a", "").await;
    let r = result(&c, &gw, &job, "key-a").await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, "x-actual-cost").is_none());
    assert_eq!(remaining(&gw, "a").await, 65);
    assert_metric(
        &gw,
        &format!("tollgate_cost_units_total{{route=\"{ROUTE}\"}}"),
        35.0,
    )
    .await;
    let done = gw.wait_access(1, |l| l["decision"] == "job_done").await;
    assert_eq!(done[0]["cost"], 35, "{done:?}");
}

/// `check` and `explain` describe an async route.
#[test]
fn check_and_explain_describe_async_routes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    let yaml = format!(
        "upstream: {{url: \"http://127.0.0.1:1\"}}\n{}",
        config(&reports(2, "        max_request_body: 512KiB\n"))
    );
    std::fs::write(&path, yaml).unwrap();
    let check = cli_ok(&path, &["check"]);
    assert!(
        check.contains("ASYNC ROUTE        WHEN    RESULT_TTL  MAX_REQUEST_BODY  MAX_RESPONSE_BODY\n/reports/generate  prefer  2s          512KiB            16MiB"),
        "{check}"
    );
    let explain = cli_ok(&path, &["explain", "POST", ROUTE]);
    assert!(
        explain.contains("async:        a request with Prefer: respond-async becomes a job"),
        "{explain}"
    );
    // A job's poll and cancel are the gateway's, on any config, in any spelling of the path
    // (DESIGN §8: they cost nothing and take no slot). It said `route: default`, `cost: 1`.
    for (method, target) in [
        ("GET", "/_tollgate/jobs/0123456789abcdef0123456789abcdef"),
        (
            "DELETE",
            "/_tollgate//jobs/0123456789abcdef0123456789abcdef",
        ),
    ] {
        let explain = cli_ok(&path, &["explain", method, target]);
        assert!(
            explain.contains("answered by:  the gateway, never forwarded")
                && explain.contains("cost:         0 (never charged, takes no slot)")
                && !explain.contains("route:"),
            "{explain}"
        );
    }
}

/// `cost_per_second` bills a job's measured upstream time when it ends, as for a request: a
/// report that ran at least 1.5 s at 20 units a second costs at least 30, whatever it was
/// admitted at (10).
#[tokio::test]
async fn a_job_is_billed_its_upstream_time() {
    let up = Upstream::start(Duration::from_millis(1500));
    let endpoints = reports(1, "").replace(
        "      async:\n",
        "      cost_per_second: 20\n      async:\n",
    );
    let gw = Gateway::start(&up, &config(&endpoints));
    let c = client();
    let job = submit(&c, &gw, ROUTE, "key-a", "").await;
    assert_eq!(result(&c, &gw, &job, "key-a").await.status(), 200);
    let left = remaining(&gw, "a").await;
    assert!(left <= 70, "charged only {} for 1.5 s", 100 - left);
    let done = gw.wait_access(1, |l| l["decision"] == "job_done").await;
    assert_eq!(done[0]["cost"].as_u64(), Some(100 - left), "{done:?}");
}

/// A job that times out (504) is billed as a synchronous 504 on its route is, on its late
/// answer: the cost that answer states. (Before, its late answer was followed for the slot
/// only: the stated 60 was never applied, and a `cost_per_second` route billed the time to
/// the answer's end, not to its head.)
#[tokio::test]
async fn a_job_that_times_out_is_billed_what_its_late_answer_states() {
    let up = Upstream::start(Duration::ZERO);
    let endpoints = reports(1, "").replace(
        "      async:\n",
        "      cost_from_response: X-Actual-Cost\n      async:\n",
    );
    let gw = impatient(&up, &config(&endpoints));
    let c = client();
    let target = format!("{ROUTE}?delay_ms=1500&actual_cost=60");
    let job = submit(&c, &gw, &target, "key-a", "").await;
    assert_eq!(result(&c, &gw, &job, "key-a").await.status(), 504);
    wait_metric(
        &gw,
        r#"tollgate_cost_reports_total{result="applied",route="/reports/generate"}"#,
        1.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(remaining(&gw, "a").await, 40);
    let failed = gw.wait_access(1, |l| l["decision"] == "job_failed").await;
    assert_eq!(failed[0]["cost"].as_u64(), Some(60), "{failed:?}");
}

/// A job whose late answer never comes is billed its `cost_per_second` time until the gateway
/// stopped following it (`abandon_timeout` here), as a synchronous 504 is (DESIGN §6: "a query
/// that ran 30 s pays for 30 s"): its slot was held that long. (Before, it was billed as at
/// `read_timeout`: 12 units for a slot held 3 s.)
#[tokio::test]
async fn a_job_whose_late_answer_never_comes_is_billed_until_abandon_timeout() {
    let up = Upstream::start(Duration::ZERO);
    let endpoints = reports(1, "").replace(
        "      cost: 10\n",
        "      cost: 2\n      cost_per_second: 10\n",
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &config(&endpoints),
        upstream_extra: "  read_timeout: 1s\n  abandon_timeout: 3s\n",
        ..GatewayOpts::default()
    });
    let c = client();
    let job = submit(&c, &gw, &format!("{ROUTE}?delay_ms=10000"), "key-a", "").await;
    assert_eq!(result(&c, &gw, &job, "key-a").await.status(), 504);
    let failed = gw.wait_access(1, |l| l["decision"] == "job_failed").await;
    let cost = failed[0]["cost"].as_u64().expect("a cost");
    assert!((30..=40).contains(&cost), "{failed:?}");
    assert_eq!(remaining(&gw, "a").await, 100 - cost);
}

/// A gateway whose key a has spent its whole budget on `/huge` (cost 100), with
/// `server.body_timeout: body_timeout`.
fn with_an_empty_key(up: &Upstream, body_timeout: &str) -> Gateway {
    let endpoints = format!("{}    /huge:\n      cost: 100\n", reports(1, ""));
    let server_extra = format!("  body_timeout: {body_timeout}\n");
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &config(&endpoints),
        server_extra: &server_extra,
        ..GatewayOpts::default()
    });
    let r = raw_request(gw.port, &raw("GET /huge", &["X-API-Key: key-a"])).unwrap();
    assert_eq!(
        (r.status, r.header("x-ratelimit-remaining")),
        (200, Some("0"))
    );
    gw
}

/// A submission's head as raw bytes: `Prefer: respond-async` with `extra` header lines.
fn submission_head(key: &str, extra: &str) -> Vec<u8> {
    format!(
        "POST /reports/generate HTTP/1.1\r\nHost: localhost\r\nX-API-Key: {key}\r\nPrefer: respond-async\r\n{extra}\r\n"
    )
    .into_bytes()
}

/// DESIGN §8: a submission is identified, classified and charged as usual — 429 if its budget
/// refuses — and that is decided before its body is read: a client waiting for `100 Continue`
/// gets its 429 at once, as on the synchronous route. One the budget admits gets the
/// `100 Continue` it asked for from the gateway, then sends its body and gets its 202.
/// (Before: the gateway read the body first and never sent `100 Continue`, so an over-budget
/// client got a 408 after body_timeout, and every client waited out its own `Expect` timer.)
#[test]
fn a_submission_is_decided_before_its_body_is_read() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let gw = with_an_empty_key(&up, "5s");
    let expect = "Expect: 100-continue\r\nContent-Length: 3\r\n";
    let mut s = raw_connect(gw.port);
    let asked = Instant::now();
    s.write_all(&submission_head("key-a", expect)).unwrap();
    let r = read_raw_response(&mut s).expect("an answer");
    let after = asked.elapsed();
    assert_eq!(r.status, 429, "after {after:?}: {r:?}");
    // At once, not after body_timeout (5 s), as the 408 came.
    assert!(
        after < Duration::from_millis(4500),
        "answered after {after:?}"
    );
    assert!(r.is_problem("quota-exceeded"), "{r:?}");
    assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() > 0);
    assert_eq!(
        (
            r.header("x-ratelimit-cost"),
            r.header("x-ratelimit-remaining")
        ),
        (Some("0"), Some("0"))
    );
    // Key b's budget admits it: 100 Continue, then the body, then the 202 (charged 10).
    let mut s = raw_connect(gw.port);
    s.write_all(&submission_head("key-b", expect)).unwrap();
    assert_eq!(read_interim(&mut s), Some(100));
    s.write_all(b"abc").unwrap();
    let r = read_raw_response(&mut s).expect("an answer");
    assert_eq!(r.status, 202, "{r:?}");
    assert_eq!(
        (
            r.header("x-ratelimit-cost"),
            r.header("x-ratelimit-remaining")
        ),
        (Some("10"), Some("90"))
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let location = r.header("location").unwrap().to_string();
        let done = result(&client(), &gw, &location, "key-b").await;
        assert_eq!(done.status(), 200);
        assert_eq!(remaining(&gw, "b").await, 90);
        assert_eq!(remaining(&gw, "a").await, 0);
    });
    assert_eq!(up.count(ROUTE), 1);
}

/// A submission that waited for `100 Continue` keeps its connection: the request it pipelined
/// behind its body is answered after the 202 (DESIGN §3: never dropped). (Before, writing the
/// `100 Continue` before the body was read turned keep-alive off: the 202 said
/// `Connection: close` and the next request was lost.)
#[test]
fn a_submission_that_waited_for_100_continue_keeps_its_connection() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(&reports(1, "")));
    let mut s = raw_connect(gw.port);
    s.write_all(&submission_head(
        "key-b",
        "Expect: 100-continue\r\nContent-Length: 3\r\n",
    ))
    .unwrap();
    assert_eq!(read_interim(&mut s), Some(100));
    let mut rest = b"abc".to_vec();
    rest.extend_from_slice(&raw("GET /items/1", &["X-API-Key: key-b"]));
    s.write_all(&rest).unwrap();
    let r = read_raw_response(&mut s).expect("the 202");
    assert_eq!(r.status, 202, "{r:?}");
    assert_eq!(r.header("connection"), Some("keep-alive"), "{r:?}");
    let next = read_raw_response(&mut s).expect("the pipelined request answered");
    assert_eq!(next.status, 200, "{next:?}");
    assert_eq!(up.count("/items/1"), 1);
}

/// A submission whose body stalls gets 408 after body_timeout; the job never existed and its
/// body never reached the upstream, so nothing is charged (as for a 413), and the 408 carries
/// every rate-limit header of an identified request (DESIGN §3), the budget as the refund left
/// it: what the key spent meanwhile on other requests counts (it said the budget was whole
/// again, the admission's figures with the charge given back). (Before that: only
/// `RateLimit-Policy`, `X-RateLimit-Limit` and `X-RateLimit-Cost`, and the access log said
/// `"decision":"error"`.)
#[test]
fn a_stalled_submission_body_is_408_uncharged_with_every_rate_limit_header() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &config(&reports(1, "")),
        server_extra: "  body_timeout: 1s\n",
        ..GatewayOpts::default()
    });
    let mut s = raw_connect(gw.port);
    s.write_all(&submission_head("key-a", "Content-Length: 100\r\n"))
        .unwrap();
    s.write_all(b"abc").unwrap();
    let stalled = Instant::now();
    // Meanwhile the key spends 3 units elsewhere (3 × 864 s of a day's 100).
    for _ in 0..3 {
        let r = raw_request(gw.port, &raw("GET /items/1", &["X-API-Key: key-a"])).unwrap();
        assert_eq!(r.status, 200);
    }
    let r = read_raw_response(&mut s).expect("an answer");
    let after = stalled.elapsed();
    assert_eq!(r.status, 408, "{r:?}");
    assert!(after < Duration::from_secs(8), "answered after {after:?}");
    assert!(r.is_problem("request-timeout"), "{r:?}");
    let h = |name| r.header(name);
    assert_eq!(h("ratelimit-policy"), Some("\"default\";q=100;w=86400"));
    // 2592 s until empty when they were spent, drained for body_timeout (1 s) and the time
    // the three took since.
    let t: u64 = h("x-ratelimit-reset").unwrap().parse().unwrap();
    let since = after.as_secs_f64().ceil() as u64;
    assert!((2592 - since..=2592).contains(&t), "{r:?} after {after:?}");
    assert_eq!(h("ratelimit"), Some(&*format!("\"default\";r=97;t={t}")));
    assert_eq!(h("x-ratelimit-limit"), Some("100"));
    assert_eq!(h("x-ratelimit-remaining"), Some("97"));
    assert_eq!(h("x-ratelimit-cost"), Some("0"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        assert_eq!(remaining(&gw, "a").await, 97);
        assert_metric(&gw, "tollgate_client_timeouts_total{kind=\"body\"}", 1.0).await;
        let line = gw.wait_access(1, |e| e["status"] == 408).await;
        assert_eq!(
            (&line[0]["decision"], &line[0]["cost"], &line[0]["route"]),
            (&"refunded".into(), &0.into(), &ROUTE.into()),
            "{line:?}"
        );
    });
    assert_eq!(up.count(ROUTE), 0);
}

/// A synchronous request whose body stalls is charged and answered 408 after body_timeout,
/// and a job's 202 comes once its body is read: both answer well after their decision, and
/// `t` counts to when the answer goes out (README), as it does for an upstream's answer. (It
/// said the decision's `t`: a 408 2 s after a charge of 10 units of a day's 100, `t=8640`.)
#[test]
fn an_answer_after_a_slow_body_counts_t_to_when_it_goes_out() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &config(&format!("{}    /upload:\n      cost: 10\n", reports(1, ""))),
        server_extra: "  body_timeout: 2s\n",
        ..GatewayOpts::default()
    });
    // 10 units: 8640 s until empty at the decision; the answer goes out at least `least`
    // later, and at most as long after it as the client waited: `t` counts that down.
    let counted_down = |r: &RawResponse, sent: Instant, least: f64| {
        let most = 8640 - sent.elapsed().as_secs_f64().ceil() as u64;
        let t: u64 = r.header("x-ratelimit-reset").unwrap().parse().unwrap();
        let upper = (8640.0 - least).ceil() as u64;
        assert!((most..=upper).contains(&t), "{r:?}");
        assert_eq!(
            r.header("ratelimit"),
            Some(&*format!("\"default\";r=90;t={t}"))
        );
    };
    let mut s = raw_connect(gw.port);
    let sent = Instant::now();
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: key-a\r\nContent-Length: 10\r\n\r\nabc")
        .unwrap();
    let r = read_raw_response(&mut s).expect("an answer");
    assert_eq!(r.status, 408, "{r:?}");
    // At least body_timeout (2 s) after the decision: t 8638 or less.
    counted_down(&r, sent, 2.0);
    // A job's body sent 2.5 s after its 100 Continue: its 202 says 8640 - 2.5 s or less.
    let mut s = raw_connect(gw.port);
    let sent = Instant::now();
    s.write_all(&submission_head(
        "key-b",
        "Content-Length: 3\r\nExpect: 100-continue\r\n",
    ))
    .unwrap();
    assert_eq!(read_interim(&mut s), Some(100));
    std::thread::sleep(Duration::from_millis(1500));
    s.write_all(b"ab").unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    s.write_all(b"c").unwrap();
    let r = read_raw_response(&mut s).expect("an answer");
    assert_eq!(r.status, 202, "{r:?}");
    counted_down(&r, sent, 2.5);
}

/// A job on a pool whose address refuses the connection goes to the pool's next address, as a
/// request does (it never reached the first): each runs once and is charged once. (Every
/// other job failed 502, refunded.)
#[tokio::test]
async fn a_job_refused_by_one_pool_address_runs_at_the_next() {
    let up = Upstream::start(Duration::ZERO);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let body = format!(
        "upstreams:\n  pool:\n    urls: [\"{dead}\", \"{}\"]\n{}",
        up.url(),
        config(&reports(1, "      upstream: pool\n")),
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    for i in 0..4 {
        let location = submit(&c, &gw, ROUTE, "key-a", "").await;
        let r = result(&c, &gw, &location, "key-a").await;
        assert_eq!(r.status(), 200, "job {i}");
    }
    assert_eq!(up.count(ROUTE), 4);
    assert_eq!(remaining(&gw, "a").await, 60);
}

/// With `max_delay` a job whose units were reserved ahead waits in the queue until they are
/// due, without a slot (`held::a_held_job_holds_no_slot_on_memory_and_redis`): meanwhile it is
/// queued in the metrics, neither running nor in flight (it held its slot and was counted
/// running), and its last access-log line says how long it was held (`hold_ms`, which said 0
/// before the hold was counted at all), not queued.
#[tokio::test]
async fn a_held_job_is_counted_queued_and_its_hold_is_logged() {
    let up = Upstream::start(Duration::from_millis(50));
    // 10 units per 4 s: a second job of 10 right after the first is due about 4 s later.
    let body = config(&reports(1, "")).replace(
        "default: {cost: 1, window: 24h, max_cost: 100}",
        "default: {cost: 1, window: 4s, max_cost: 10, max_delay: 5s}",
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let charged = Instant::now();
    let first = submit(&c, &gw, ROUTE, "key-a", "").await;
    assert_eq!(result(&c, &gw, &first, "key-a").await.status(), 200);
    // Its 202, and a poll while it is held, say to come back once it can have run: after its
    // hold (about 4 s) and its run, not after one upstream time (they said 1).
    let second = submit_held(&c, &gw, ROUTE, charged, 4.0).await;
    let queued = format!("tollgate_jobs{{route=\"{ROUTE}\",state=\"queued\"}}");
    wait_metric(&gw, &queued, 1.0, Duration::from_secs(2)).await;
    assert_eq!(up.count(ROUTE), 1, "held, not sent yet");
    let running = format!("tollgate_jobs{{route=\"{ROUTE}\",state=\"running\"}}");
    assert_metric(&gw, &running, 0.0).await;
    assert_metric(
        &gw,
        &format!("tollgate_in_flight{{route=\"{ROUTE}\"}}"),
        0.0,
    )
    .await;
    assert_eq!(result(&c, &gw, &second, "key-a").await.status(), 200);
    let id = second.trim_start_matches("/_tollgate/jobs/").to_string();
    let done = gw
        .wait_access(1, |l| {
            l["decision"] == "job_done" && l["job"] == id.as_str()
        })
        .await;
    let hold = done[0]["hold_ms"].as_f64().unwrap();
    assert!((2500.0..5000.0).contains(&hold), "{}", done[0]);
    let queue = done[0]["queue_ms"].as_f64().unwrap();
    assert!(queue < 1000.0, "{}", done[0]);
}
