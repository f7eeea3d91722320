//! Async jobs on a Redis fleet (DESIGN §8, issue 26): a job's record and its waiter live in
//! Redis, not in the instance that accepted it, so any gateway of the fleet answers its polls,
//! whichever gets the route's slot runs it, a queued job outlives its accepting instance, and a
//! job whose running instance dies ends `failed` (`job-lost`, charged) and is never run again.

mod common;

use std::time::{Duration, Instant};

use common::*;

const ROUTE: &str = "/reports/generate";
/// A job that keeps its slot for 5 s: longer than any step a test takes while it runs (the
/// others answer in the upstream's 200 ms), so that no assertion races its end.
const HELD: &str = "/reports/generate?delay_ms=5000";
/// The fleet's `store.lease_ttl`: a dead runner's job is `failed` within it.
const LEASE_TTL: Duration = Duration::from_secs(2);

/// Keys `a` and `b` (raw `key-a`, `key-b`) with a 24 h budget of 100 on `redis`, and
/// `/reports/generate` costing 10, capped at 1, async (results kept 30 s).
fn config(url: &str) -> String {
    config_kept(url, "30s")
}

fn config_kept(url: &str, result_ttl: &str) -> String {
    config_with(url, result_ttl, 1)
}

fn config_with(url: &str, result_ttl: &str, cap: u32) -> String {
    let keys: String = ["a", "b"].iter().map(|id| registry_key(id, "")).collect();
    format!(
        "store:\n  backend: redis\n  url: \"{url}\"\n  timeout: 250ms\n  on_error: deny\n  lease_ttl: {lease}s\n\
         rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    {ROUTE}:\n      cost: 10\n      max_in_flight: {cap}\n      async:\n        result_ttl: {result_ttl}\nkeys:\n{keys}",
        lease = LEASE_TTL.as_secs(),
    )
}

/// A gateway on the Redis at `url` (`config`) whose route has `route_extra` (YAML lines under
/// it) and whose upstream has `upstream_extra` (its timeouts).
fn timed_gateway(up: &Upstream, url: &str, route_extra: &str, upstream_extra: &str) -> Gateway {
    let body = config(url).replace("      async:\n", &format!("{route_extra}      async:\n"));
    Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        upstream_extra,
        ..GatewayOpts::default()
    })
}

/// Submits a job on `gw`: its location and the 202's JSON.
async fn submit(
    c: &reqwest::Client,
    gw: &Gateway,
    target: &str,
    body: &str,
) -> (String, serde_json::Value) {
    submit_as(c, gw, target, body, "key-a").await
}

async fn submit_as(
    c: &reqwest::Client,
    gw: &Gateway,
    target: &str,
    body: &str,
    key: &str,
) -> (String, serde_json::Value) {
    let r = post_async(
        c,
        gw.url(target),
        key,
        body,
        &[("X-Request-Id", "fleet-job")],
    )
    .await;
    assert_eq!(r.status(), 202, "{:?}", r.text().await);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("10"));
    let location = job_location(&r);
    (location, r.json().await.unwrap())
}

/// Polls `location` on `gw` until the job is no longer queued or running.
/// The access-log line `gw` wrote when the job at `location` ended as `decision`: the only one.
async fn job_end_line(gw: &Gateway, location: &str, decision: &str) -> serde_json::Value {
    let id = location.rsplit('/').next().unwrap().to_string();
    let lines = gw
        .wait_access(1, |l| l["job"] == *id && l["decision"] == decision)
        .await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["route"], "/reports/generate");
    lines[0].clone()
}

/// The job at `location` ended 200 (read on `gw`), sent upstream once, and key a charged its
/// 10 once (of 100).
async fn ran_once_charged_once(c: &reqwest::Client, gw: &Gateway, up: &Upstream, location: &str) {
    let done = result(c, gw, location).await;
    assert_eq!(done.status(), 200, "{:?}\n{}", done.text().await, gw.log());
    assert_eq!(up.count(ROUTE), 1);
    assert_eq!(remaining(gw, "a").await, 90);
}

async fn result(c: &reqwest::Client, gw: &Gateway, location: &str) -> reqwest::Response {
    result_as(c, gw, location, "key-a").await
}

async fn result_as(
    c: &reqwest::Client,
    gw: &Gateway,
    location: &str,
    key: &str,
) -> reqwest::Response {
    // Polls are free.
    job_result(c, gw, location, key, Duration::from_secs(30), |r| {
        assert_eq!(header(r, "x-ratelimit-cost").as_deref(), Some("0"));
    })
    .await
}

/// Submitted on gateway A, polled on gateway B: 202 while it runs, then the upstream's answer
/// as it came, on both; the upstream saw the request once; charged once fleet-wide; polls
/// free; another key 404 on either gateway.
#[tokio::test]
async fn a_job_submitted_on_one_gateway_is_read_on_another() {
    let redis = Redis::start();
    submitted_on_one_read_on_another(&redis.url(), &|args| redis.cli(args)).await;
}

/// The same on a Redis Cluster: the job's record (`t:j:<id>`, a slot of its own), its
/// key's budget and its route's queue on whichever nodes own them.
#[tokio::test]
async fn on_a_redis_cluster_a_job_submitted_on_one_gateway_is_read_on_another() {
    let cluster = RedisCluster::start(3);
    let on_owner = |args: &[&str]| cluster.node(cluster.owner(args[1])).cli(args);
    submitted_on_one_read_on_another(&cluster.url(), &on_owner).await;
}

/// `cli` runs a command on the node that holds its first key.
async fn submitted_on_one_read_on_another(url: &str, cli: &dyn Fn(&[&str]) -> String) {
    let up = Upstream::start(Duration::from_millis(1000));
    let a = Gateway::start(&up, &config(url));
    let b = Gateway::start(&up, &config(url));
    let c = client();
    let target = "/reports/generate?echo_body=1";
    let (location, accepted) = submit(&c, &a, target, "the report's parameters").await;
    assert_eq!(accepted["status"], "queued");
    let id = location.strip_prefix("/_tollgate/jobs/").unwrap();
    assert_eq!(accepted["id"], id);
    assert_eq!(id.len(), 32, "{id}");

    up.wait_current(ROUTE, 1).await;
    let running = get(&c, b.url(&location), "key-a").await;
    assert_eq!(running.status(), 202);
    // Every rate-limit header, read from Redis on the other gateway: the 10 charged on A.
    assert_eq!(
        header(&running, "x-ratelimit-remaining").as_deref(),
        Some("90")
    );
    assert!(header(&running, "ratelimit").is_some_and(|v| v.contains(";r=90;")));
    let v: serde_json::Value = running.json().await.unwrap();
    assert_eq!(v["status"], "running");
    assert_eq!(get(&c, b.url(&location), "key-b").await.status(), 404);
    assert_eq!(c.get(b.url(&location)).send().await.unwrap().status(), 401);

    let done = result(&c, &b, &location).await;
    assert_eq!(done.status(), 200);
    assert_eq!(
        header(&done, "content-type").as_deref(),
        Some("application/json")
    );
    let echo: serde_json::Value = done.json().await.unwrap();
    assert_eq!(
        (
            &echo["method"],
            &echo["path"],
            &echo["query"],
            &echo["body"]
        ),
        (
            &serde_json::json!("POST"),
            &serde_json::json!(ROUTE),
            &serde_json::json!("echo_body=1"),
            &serde_json::json!("the report's parameters")
        )
    );
    assert_eq!(echo["headers"]["x-request-id"], "fleet-job");
    // The same answer on the accepting gateway; another key sees nothing there either.
    let on_a = get(&c, a.url(&location), "key-a").await;
    assert_eq!(on_a.status(), 200);
    assert_eq!(on_a.json::<serde_json::Value>().await.unwrap(), echo);
    assert_eq!(get(&c, a.url(&location), "key-b").await.status(), 404);

    let seen = up.seen_on(ROUTE);
    assert_eq!(
        (seen.len(), seen[0].method.as_str(), seen[0].target.as_str()),
        (1, "POST", target)
    );
    assert_eq!(remaining(&a, "a").await, 90);
    assert_eq!(remaining(&b, "a").await, 90);
    // The record names the key by its hash; the request's headers (the forwarded credential
    // among them, as forward_credentials says) are dropped once the job has ended.
    let record = redis_job_key(id);
    assert_eq!(cli(&["HGET", &record, "key"]), sha256_hex("key-a"));
    assert_eq!(cli(&["HEXISTS", &record, "headers"]), "0");
    assert_eq!(cli(&["HEXISTS", &record, "body"]), "0");
    assert!(!a.log().contains("key-a") && !b.log().contains("key-a"));
}

/// A job queued behind a synchronous request on B, accepted by A, and A SIGKILLed while the
/// job waits: it still runs, once, via B, and is charged once.
#[tokio::test]
async fn a_queued_job_outlives_the_instance_that_accepted_it() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(1500));
    let mut a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    // B's synchronous request holds the route's only slot.
    let sync = tokio::spawn({
        let (c, url) = (c.clone(), b.url(ROUTE));
        async move { post(&c, url, "key-a").await.status() }
    });
    up.wait_current(ROUTE, 1).await;
    let (location, accepted) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(
        (accepted["status"].as_str(), accepted["position"].as_u64()),
        (Some("queued"), Some(1))
    );
    a.kill9();
    assert_eq!(sync.await.unwrap(), 200);
    let done = result(&c, &b, &location).await;
    assert_eq!(done.status(), 200);
    assert_eq!(up.count(ROUTE), 2);
    assert_eq!(up.max_concurrent(ROUTE), 1);
    // Charged once each: the synchronous request and the job.
    assert_eq!(remaining(&b, "a").await, 80);
    assert_metric(
        &b,
        "tollgate_jobs_total{result=\"done\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
}

/// DESIGN §8's `position` on a fleet: submitted on one gateway, polled on another, it is the
/// job's place in the fleet's fair order and moves up as the queue drains (it was the place
/// in arrival order at submission, frozen: key b's one job said 3, and a's last said 2 until
/// it ran).
#[tokio::test]
async fn a_jobs_position_is_its_place_in_the_fleets_fair_order() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(2500));
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&redis.url()));
    job_positions_follow_the_fair_order(&up, &a, &b, ROUTE).await;
}

/// The instance running a job SIGKILLed: the job ends `failed` (502 `job-lost`) within about
/// lease_ttl, stays charged (DESIGN §8: the upstream had it) and is never run again; its slot
/// comes back, so the next job runs.
#[tokio::test]
async fn a_job_whose_runner_dies_fails_and_is_not_run_again() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(3000));
    let mut a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    // A slot is free: A runs the job it accepts.
    let (location, _) = submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    a.kill9();
    let killed = Instant::now();
    let lost = result(&c, &b, &location).await;
    let within = killed.elapsed();
    assert_eq!(lost.status(), 502);
    let p: serde_json::Value = lost.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("job-lost"), "{p}");
    // lease_ttl, with slack for a loaded machine.
    assert!(within < LEASE_TTL + Duration::from_secs(4), "{within:?}");
    assert_eq!(remaining(&b, "a").await, 90);
    assert_metric(
        &b,
        "tollgate_jobs_total{result=\"failed\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    // The instance that found it lost writes its last line (README: one when the job ends).
    let line = job_end_line(&b, &location, "job_failed").await;
    assert_eq!(
        (line["status"].as_u64(), line["cost"].as_u64()),
        (Some(502), Some(10))
    );

    // Its slot came back with its lapsed lease: the next job runs (via B), and the lost one
    // was not run again meanwhile.
    let (next, _) = submit(&c, &b, ROUTE, "").await;
    assert_eq!(result(&c, &b, &next).await.status(), 200);
    assert_eq!(get(&c, b.url(&location), "key-a").await.status(), 502);
    assert_eq!(up.count(ROUTE), 2);
    assert_eq!(remaining(&b, "a").await, 80);
}

/// A job that finds no slot within result_ttl never runs: its poll (on another gateway) is
/// 503 `route-busy`, it is refunded and counted `expired`, and the slot freed later goes to
/// nobody on its behalf.
#[tokio::test]
async fn a_job_that_waits_past_result_ttl_expires_refunded() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(4000));
    let a = Gateway::start(&up, &config_kept(&redis.url(), "1s"));
    let b = Gateway::start(&up, &config_kept(&redis.url(), "1s"));
    let c = client();
    let sync = tokio::spawn({
        let (c, url) = (c.clone(), b.url(ROUTE));
        async move { post(&c, url, "key-a").await.status() }
    });
    up.wait_current(ROUTE, 1).await;
    let (location, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(remaining(&b, "a").await, 80);
    let queued: serde_json::Value = get(&c, b.url(&location), "key-a")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (queued["status"].as_str(), queued["position"].as_u64()),
        (Some("queued"), Some(1))
    );
    let expired = result(&c, &b, &location).await;
    assert_eq!(expired.status(), 503);
    assert_eq!(header(&expired, "retry-after").as_deref(), Some("1"));
    let p: serde_json::Value = expired.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("route-busy"), "{p}");
    assert_eq!(remaining(&b, "a").await, 90);
    assert_metric(
        &b,
        "tollgate_jobs_total{result=\"expired\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    let line = job_end_line(&b, &location, "job_expired").await;
    assert_eq!(
        (line["status"].as_u64(), line["cost"].as_u64()),
        (Some(503), Some(0))
    );
    assert!(line["queue_ms"].as_f64().unwrap() >= 1000.0, "{line}");
    assert_eq!(sync.await.unwrap(), 200);
    // The slot is free again and nothing of the job's is left to run: a new job runs alone.
    let (next, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(result(&c, &b, &next).await.status(), 200);
    assert_eq!(up.count(ROUTE), 2);
}

/// DELETE on gateway B of a job queued by gateway A: 200 `cancelled`, refunded, never sent;
/// another key 404; the running job 409 (and it still finishes, once).
#[tokio::test]
async fn a_queued_job_is_cancelled_from_another_gateway() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(2000));
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    let (first, _) = submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(remaining(&b, "a").await, 80);
    let delete = |gw: &Gateway, location: &str, key: &str| {
        c.delete(gw.url(location)).header("X-API-Key", key).send()
    };
    assert_eq!(delete(&b, &second, "key-b").await.unwrap().status(), 404);
    let cancelled = delete(&b, &second, "key-a").await.unwrap();
    assert_eq!(cancelled.status(), 200);
    let v: serde_json::Value = cancelled.json().await.unwrap();
    assert_eq!(v["status"], "cancelled");
    assert_eq!(remaining(&b, "a").await, 90);
    assert_eq!(get(&c, a.url(&second), "key-a").await.status(), 404);
    assert_metric(
        &b,
        "tollgate_jobs_total{result=\"cancelled\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    let line = job_end_line(&b, &second, "job_cancelled").await;
    assert_eq!(
        (line["status"].as_u64(), line["cost"].as_u64()),
        (Some(499), Some(0))
    );
    assert_eq!(line["key"], "a");
    assert_eq!(line["method"], "POST");
    assert_eq!(delete(&b, &first, "key-a").await.unwrap().status(), 409);
    assert_eq!(result(&c, &b, &first).await.status(), 200);
    // The cancelled job's turn came and went: only the first was sent.
    let (third, _) = submit(&c, &b, ROUTE, "").await;
    assert_eq!(result(&c, &a, &third).await.status(), 200);
    assert_eq!(up.count(ROUTE), 2);
}

/// Twenty jobs of key a and then one of key b, on cap 2, submitted through two gateways: all
/// done, never more than 2 at the upstream, each sent once, and b's job among the first two
/// started after it was submitted (in arrival order it would wait behind 18).
#[tokio::test]
async fn jobs_of_two_gateways_share_a_full_route_fairly() {
    let redis = Redis::start();
    two_gateways_share_a_full_route_fairly(&redis.url()).await;
}

#[tokio::test]
async fn on_a_redis_cluster_jobs_of_two_gateways_share_a_full_route_fairly() {
    let cluster = RedisCluster::start(3);
    two_gateways_share_a_full_route_fairly(&cluster.url()).await;
}

async fn two_gateways_share_a_full_route_fairly(url: &str) {
    let up = Upstream::start(Duration::from_millis(500));
    // A budget of 1000: room for 20 jobs of 10.
    let body = config_with(url, "1m", 2).replace("max_cost: 100}", "max_cost: 1000}");
    let gws = [Gateway::start(&up, &body), Gateway::start(&up, &body)];
    let c = client();
    let mut jobs = vec![];
    for i in 0..20 {
        let gw = &gws[i % 2];
        jobs.push((submit_as(&c, gw, ROUTE, "", "key-a").await.0, "key-a"));
    }
    up.wait_current(ROUTE, 2).await;
    let (b_job, _) = submit_as(&c, &gws[1], ROUTE, "", "key-b").await;
    let before_b = up.count(ROUTE);
    jobs.push((b_job, "key-b"));
    for (i, (location, key)) in jobs.iter().enumerate() {
        assert_eq!(
            result_as(&c, &gws[i % 2], location, key).await.status(),
            200
        );
    }
    assert_eq!(up.count(ROUTE), 21);
    assert_eq!(up.max_concurrent(ROUTE), 2);
    let order = up.keys_in_order(ROUTE);
    let b_at = order.iter().position(|k| k == "key-b").unwrap() as u64;
    assert!(
        b_at < before_b + 2,
        "key b ran {b_at}th of {order:?} (submitted after {before_b} had started)"
    );
    // Charged once each, fleet-wide.
    assert_eq!(remaining(&gws[0], "a").await, 800);
    assert_eq!(remaining(&gws[1], "b").await, 990);
    // Each job's end counted once, by the gateway that ran it (just after its result is
    // written: polled for a while).
    let done = "tollgate_jobs_total{result=\"done\",route=\"/reports/generate\"} ";
    let start = Instant::now();
    loop {
        let mut total = 0.0;
        for gw in &gws {
            let text = reqwest::get(gw.admin("/metrics")).await.unwrap();
            let text = text.text().await.unwrap();
            total += text
                .lines()
                .find_map(|l| {
                    l.strip_prefix(done)
                        .and_then(|v| v.trim().parse::<f64>().ok())
                })
                .unwrap_or(0.0);
        }
        if total == 21.0 || start.elapsed() > Duration::from_secs(5) {
            assert_eq!(total, 21.0);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With `max_delay` a job's units may be reserved ahead: it runs no sooner than they are due,
/// whichever instance runs it (as on the memory store).
#[tokio::test]
async fn a_job_admitted_ahead_runs_no_sooner_than_its_units_are_due() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(100));
    // 10 units per 4 s: a second job of 10 right after the first is due 4 s later.
    let body = config_with(&redis.url(), "1m", 2).replace(
        "default: {cost: 1, window: 24h, max_cost: 100}",
        "default: {cost: 1, window: 4s, max_cost: 10, max_delay: 5s}",
    );
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let charged = Instant::now();
    let (first, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(result(&c, &b, &first).await.status(), 200);
    let submitted = Instant::now();
    // Its 202, and a poll while it is held, say to come back once it can have run: after its
    // hold (about 4 s) and its run, not after one upstream time (they said 1).
    let second = submit_held(&c, &a, ROUTE, charged, 4.0).await;
    assert_eq!(result(&c, &b, &second).await.status(), 200);
    let waited = submitted.elapsed();
    assert_eq!(up.count(ROUTE), 2);
    // Due about 4 s after the first (which took at least 100 ms): a lower bound only.
    assert!(waited >= Duration::from_millis(3000), "{waited:?}");
}

/// Redis unreachable at submission: no job can be stored, so the answer is 503
/// `store-unavailable` whatever `on_error` says (here `allow`), and nothing reaches the upstream.
#[tokio::test]
async fn a_submission_without_redis_is_refused() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(100));
    let body = config(&redis.url()).replace("on_error: deny", "on_error: allow");
    let a = Gateway::start(&up, &body);
    redis.kill();
    let c = client();
    let r = c
        .post(a.url(ROUTE))
        .header("X-API-Key", "key-a")
        .header("Prefer", "respond-async")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(header(&r, "location").is_none());
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("store-unavailable"),
        "{p}"
    );
    assert_eq!(up.count(ROUTE), 0);
}

/// SIGTERM to the instance running a fleet job, with another job of its queued: it finishes
/// the running one within `grace_period` and exits 0; the queued one is not started there
/// but runs via the other instance, once, after it.
#[tokio::test]
async fn sigterm_finishes_the_running_job_and_leaves_the_queued_one_to_the_fleet() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url());
    let mut a = Gateway::start_with_grace(&up, &body, "10s");
    let b = Gateway::start(&up, &body);
    let c = client();
    // A slot is free: A runs the first job itself.
    let (running, _) = submit(&c, &a, HELD, "").await;
    up.wait_current(ROUTE, 1).await;
    let (queued, accepted) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(accepted["status"], "queued");
    a.signal("TERM");
    assert_eq!(a.wait_exit(Duration::from_secs(15)), Some(0), "{}", a.log());
    let id = |loc: &str| loc.rsplit('/').next().unwrap().to_string();
    let ended = |gw: &Gateway| -> Vec<String> {
        gw.access_log()
            .into_iter()
            .filter(|l| l["decision"] == "job_done")
            .map(|l| l["job"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ended(&a), [id(&running)], "{}", a.log());
    assert_eq!(result(&c, &b, &running).await.status(), 200);
    assert_eq!(result(&c, &b, &queued).await.status(), 200);
    // The job's last access-log line comes just after its result is readable.
    let since = Instant::now();
    while ended(&b).is_empty() && since.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(ended(&b), [id(&queued)], "{}", b.log());
    assert_eq!(up.count(ROUTE), 2);
    assert_eq!(up.max_concurrent(ROUTE), 1);
    assert_eq!(remaining(&b, "a").await, 80);
}

/// SIGTERM to an instance running a job its collector started (the job was queued, and its
/// slot came to this instance when the first job ended): the job finishes within
/// `grace_period`, 200, and the instance exits 0 after it. (Before, the collector's runtime
/// ended with the drain, and every job it had started with it: the instance exited at once
/// and the job ended 502 `job-lost`, charged, its upstream's answer thrown away.)
#[tokio::test]
async fn sigterm_finishes_a_job_the_collector_started() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url());
    let mut a = Gateway::start_with_grace(&up, &body, "10s");
    let c = client();
    let (first, _) = submit(&c, &a, "/reports/generate?delay_ms=500", "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, accepted) = submit(&c, &a, "/reports/generate?delay_ms=3000", "").await;
    assert_eq!(accepted["status"], "queued");
    assert_eq!(result(&c, &a, &first).await.status(), 200);
    // A's collector took the freed slot (the only instance): the second runs there now.
    eventually(Duration::from_secs(5), async || match up.count(ROUTE) {
        2 => Ok(()),
        n => Err(format!("{n} sent")),
    })
    .await;
    a.signal("TERM");
    let asked = Instant::now();
    assert_eq!(a.wait_exit(Duration::from_secs(15)), Some(0), "{}", a.log());
    assert!(
        asked.elapsed() >= Duration::from_millis(1500),
        "exited before its job ended: {:?}",
        asked.elapsed()
    );
    let b = Gateway::start(&up, &body);
    let done = result(&c, &b, &second).await;
    assert_eq!(done.status(), 200, "{:?}", done.text().await);
    assert_eq!(up.count(ROUTE), 2);
    assert_eq!(remaining(&b, "a").await, 80);
}

/// The whole fleet restarted (one instance, SIGTERM, started again) while one job runs and
/// two wait: the running job ends during the drain and its slot is granted to the first
/// queued one, which no instance takes (a draining instance starts no job). The grant lapses
/// and the job goes back to the queue (DESIGN §8: "a queued job still runs"), so the next
/// instance runs both, once each and one at a time (the grant that lapsed is handed out once
/// more, not twice: a second copy once released the running job's slot to the third).
#[tokio::test]
async fn a_queued_job_granted_while_the_whole_fleet_drains_runs_after_the_restart() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url());
    let mut a = Gateway::start_with_grace(&up, &body, "10s");
    let c = client();
    let (running, _) = submit(&c, &a, "/reports/generate?delay_ms=1000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (queued, accepted) = submit(&c, &a, "/reports/generate?delay_ms=600", "").await;
    assert_eq!(accepted["status"], "queued");
    let (third, _) = submit(&c, &a, "/reports/generate?delay_ms=600", "").await;
    a.signal("TERM");
    assert_eq!(a.wait_exit(Duration::from_secs(15)), Some(0), "{}", a.log());
    assert_eq!(
        up.count(ROUTE),
        1,
        "a draining instance started the queued job"
    );
    let b = Gateway::start(&up, &body);
    for job in [&running, &queued, &third] {
        assert_eq!(result(&c, &b, job).await.status(), 200, "{job}");
    }
    assert_eq!(up.count(ROUTE), 3);
    assert_eq!(up.max_concurrent(ROUTE), 1);
    assert_eq!(remaining(&b, "a").await, 70);
}

/// Redis unreachable (paused) for longer than lease_ttl while one job runs and one waits:
/// when it answers again the running job's lease has lapsed and its slot goes to the queued
/// job, granted in the reply to a beat the collector sent during the pause and gave up on.
/// Nobody confirms that grant; it lapses and the job goes back to its place, so it runs,
/// once, instead of waiting out its result_ttl.
#[tokio::test]
async fn a_queued_job_whose_grant_was_lost_while_redis_was_away_still_runs() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url());
    let a = Gateway::start(&up, &body);
    let _b = Gateway::start(&up, &body);
    let c = client();
    let (running, _) = submit(&c, &a, "/reports/generate?delay_ms=1000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (queued, accepted) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(accepted["status"], "queued");
    redis.pause();
    tokio::time::sleep(LEASE_TTL * 5 / 2).await;
    redis.resume();
    // Polls are 503 until the gateway's breaker lets it try Redis again.
    let since = Instant::now();
    while get(&c, a.url(&queued), "key-a").await.status() == 503 {
        assert!(since.elapsed() < Duration::from_secs(10), "Redis not back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let done = result(&c, &a, &queued).await;
    assert_eq!(done.status(), 200, "{}", a.log());
    // The first job's runner was cut off past its lease: whatever its poll says, it ran once.
    let _ = result(&c, &a, &running).await;
    assert_eq!(up.count(ROUTE), 2);
}

/// A job the fleet runs is observed as the memory store's jobs and synchronous requests are
/// (DESIGN §5, §6): in `tollgate_in_flight` while it runs, its upstream time in
/// `tollgate_upstream_duration_seconds` and the access log, its stated cost in
/// `tollgate_cost_reports_total` (and so in `audit`).
#[tokio::test]
async fn a_fleet_job_is_counted_in_the_routes_metrics() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url()).replace(
        "      async:\n",
        "      cost_from_response: X-Actual-Cost\n      async:\n",
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let series = |name: &str| format!("{name}{{route=\"{ROUTE}\"}}");
    let (held, _) = submit(&c, &gw, "/reports/generate?delay_ms=1500", "").await;
    up.wait_current(ROUTE, 1).await;
    assert_metric(&gw, &series("tollgate_in_flight"), 1.0).await;
    // Queued behind it (the cap is 1) for most of its 1.5 s.
    let (stated, _) = submit(&c, &gw, "/reports/generate?actual_cost=7", "").await;
    assert_eq!(result(&c, &gw, &held).await.status(), 200);
    assert_eq!(result(&c, &gw, &stated).await.status(), 200);
    let done = gw.wait_access(2, |l| l["decision"] == "job_done").await;
    for l in &done {
        assert!(l["upstream_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{l}");
        // DESIGN §5: the client's address on every line; its latency from its submission
        // (it said the run's alone, and no address).
        assert_eq!(l["client"], "127.0.0.1", "{l}");
        let ms = |f: &str| l[f].as_f64().unwrap_or(0.0);
        assert!(
            ms("latency_ms") + 1.0 >= ms("queue_ms") + ms("upstream_ms"),
            "{l}"
        );
    }
    assert!(
        done.iter()
            .any(|l| l["queue_ms"].as_f64().unwrap_or(0.0) > 500.0),
        "{done:?}"
    );
    assert_metric(&gw, &series("tollgate_in_flight"), 0.0).await;
    assert_metric(
        &gw,
        &series("tollgate_upstream_duration_seconds_count"),
        2.0,
    )
    .await;
    for (result, n) in [("applied", 1.0), ("missing", 1.0)] {
        assert_metric(
            &gw,
            &format!("tollgate_cost_reports_total{{result=\"{result}\",route=\"{ROUTE}\"}}"),
            n,
        )
        .await;
    }
    assert_eq!(remaining(&gw, "a").await, 100 - 10 - 7);
}

/// A fleet job that times out (504) is observed as a synchronous 504 is: its upstream time,
/// until the timeout, in `tollgate_upstream_duration_seconds` and its end line's
/// `upstream_ms`. (Before, in neither: a route whose jobs time out looked cheaper in `audit`.)
#[tokio::test]
async fn a_fleet_job_that_times_out_counts_its_upstream_time() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = timed_gateway(&up, &redis.url(), "", "  read_timeout: 500ms\n");
    let c = client();
    let (slow, _) = submit(&c, &gw, "/reports/generate?delay_ms=5000", "").await;
    assert_eq!(result(&c, &gw, &slow).await.status(), 504);
    let failed = gw.wait_access(1, |l| l["decision"] == "job_failed").await;
    let ms = failed[0]["upstream_ms"].as_f64().unwrap_or_default();
    assert!((500.0..4000.0).contains(&ms), "{}", failed[0]);
    assert_metric(
        &gw,
        &format!("tollgate_upstream_duration_seconds_count{{route=\"{ROUTE}\"}}"),
        1.0,
    )
    .await;
}

/// A fleet job that times out is billed what its late answer states, as a synchronous 504
/// on its route is (before, its admission's 10 stood and the report was not counted).
#[tokio::test]
async fn a_fleet_job_that_times_out_is_billed_what_its_late_answer_states() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = timed_gateway(
        &up,
        &redis.url(),
        "      cost_from_response: X-Actual-Cost\n",
        "  read_timeout: 500ms\n",
    );
    let c = client();
    let target = format!("{ROUTE}?delay_ms=1500&actual_cost=60");
    let (job, _) = submit(&c, &gw, &target, "").await;
    assert_eq!(result(&c, &gw, &job).await.status(), 504);
    wait_metric(
        &gw,
        &format!("tollgate_cost_reports_total{{result=\"applied\",route=\"{ROUTE}\"}}"),
        1.0,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(remaining(&gw, "a").await, 40);
    let failed = gw.wait_access(1, |l| l["decision"] == "job_failed").await;
    assert_eq!(failed[0]["cost"].as_u64(), Some(60), "{failed:?}");
}

/// A fleet job that timed out, whose late answer never comes, is billed its
/// `cost_per_second` time until `abandon_timeout` (2 s here: 20 units at 10 a second), also
/// when writing its result takes Redis longer: its late answer is followed from the timeout
/// on, beside the write. (Before, it was followed only once the write went through, here at
/// about 3.5 s, and billed until then: about 35.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_jobs_late_answer_is_billed_apart_from_the_time_its_result_takes_to_write() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let gw = timed_gateway(
        &up,
        &proxy.url(),
        "      cost_per_second: 10\n",
        "  read_timeout: 1s\n  abandon_timeout: 2s\n",
    );
    let c = client();
    let (job, _) = submit(&c, &gw, "/reports/generate?delay_ms=20000", "").await;
    up.wait_current(ROUTE, 1).await;
    let sent = Instant::now();
    // The job's result (its 504) is held on its way to Redis until 3 s after it was sent;
    // its runner's next try (its fourth, at about 3.5 s) goes through.
    proxy.hold_matching("finish");
    tokio::time::sleep_until((sent + Duration::from_secs(3)).into()).await;
    proxy.heal();
    assert_eq!(result(&c, &gw, &job).await.status(), 504);
    let failed = gw.wait_access(1, |l| l["decision"] == "job_failed").await;
    let cost = failed[0]["cost"].as_u64().expect("a cost");
    assert!((20..=27).contains(&cost), "{failed:?}");
    assert_eq!(remaining(&gw, "a").await, 100 - cost);
}

/// A job whose result write is lost on its way to Redis (the connection cut under it) ends
/// done with the upstream's answer: its runner sends the result again, still vouching for the
/// job. (Before, the one failed write was dropped: a lease later the job ended `job-lost`
/// (502), counted both done and failed, with two end lines — what a store outage of a second
/// or two did to every job that finished in it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_write_that_fails_is_sent_again() {
    let redis = Redis::start();
    let path = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(&path.url()));
    let c = client();
    // 2 s at the upstream: the drop is armed well before the result is written (and after
    // the job's script was loaded: its text names `finish` too).
    let (job, _) = submit(&c, &gw, "/reports/generate?delay_ms=2000", "").await;
    up.wait_current(ROUTE, 1).await;
    path.drop_next_matching("finish");
    // A poll on the connection cut under it is 503 (the store did not answer), then the end.
    let status = eventually(Duration::from_secs(10), async || {
        match get(&c, gw.url(&job), "key-a").await.status().as_u16() {
            202 | 503 => Err("not ended yet".to_string()),
            s => Ok(s),
        }
    })
    .await;
    assert_eq!(status, 200);
    let ends = gw
        .wait_access(1, |l| {
            l["decision"] == "job_done" || l["decision"] == "job_failed"
        })
        .await;
    assert_eq!(ends[0]["decision"], "job_done", "{}", ends[0]);
    // A lease later nobody took it for lost.
    tokio::time::sleep(LEASE_TTL + Duration::from_millis(500)).await;
    assert_eq!(result(&c, &gw, &job).await.status(), 200);
    let series = |r: &str| format!("tollgate_jobs_total{{result=\"{r}\",route=\"{ROUTE}\"}}");
    assert_metric(&gw, &series("done"), 1.0).await;
    assert_metric(&gw, &series("failed"), 0.0).await;
    assert_eq!(up.count(ROUTE), 1);
}

/// Redis restarted without persistence while one job runs and one waits: Redis's data is
/// gone (README, "Long-running requests as jobs"), and with it both records and the queued
/// job's waiter: their polls are 404 and the queued one never runs. What the contract keeps:
/// the running job is not sent twice, the cap holds (the runner's slot is registered again
/// before anyone else's: `max_concurrent` stays 1), and jobs submitted afterwards run, once.
#[tokio::test]
async fn a_redis_restart_loses_the_jobs_it_held_and_the_fleet_goes_on() {
    let mut redis = Redis::start();
    let port = redis.port;
    // Longer than the 2 s other instances hold back after a new run_id: the running job's
    // slot must be registered again, not merely outlasted.
    let up = Upstream::start(Duration::from_millis(4000));
    let body = config(&redis.url());
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let (running, _) = submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    let (queued, _) = submit(&c, &b, ROUTE, "").await;
    redis.kill();
    // Redis down: a poll is 503, not 404 (the job may exist; the client asks again).
    let down = get(&c, b.url(&queued), "key-a").await;
    assert_eq!(down.status(), 503);
    assert_eq!(header(&down, "retry-after").as_deref(), Some("1"));
    let p: serde_json::Value = down.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("store-unavailable"),
        "{p}"
    );
    let _redis = Redis::start_on(port);
    // The next job is submitted while the first still runs: refused (on_error: deny) until B
    // has connected again.
    let since = Instant::now();
    let after = loop {
        let r = post_async(&c, b.url(ROUTE), "key-b", "", &[]).await;
        if r.status() == 202 {
            break job_location(&r);
        }
        assert_eq!(r.status(), 503);
        assert!(since.elapsed() < Duration::from_secs(5), "Redis not back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(result_as(&c, &b, &after, "key-b").await.status(), 200);
    for lost in [&running, &queued] {
        assert_eq!(get(&c, b.url(lost), "key-a").await.status(), 404, "{lost}");
    }
    assert_eq!(up.count(ROUTE), 2, "the lost queued job never runs");
    assert_eq!(up.max_concurrent(ROUTE), 1);
}

/// `tollgate_jobs{state="queued"}` on Redis is the route's queued jobs fleet-wide, as each
/// instance's last beat saw them (the same figure on every instance: aggregate with `max`);
/// `running` is the jobs this instance runs. `/admin/routes` gives both.
#[tokio::test]
async fn every_instance_sees_the_fleets_queued_jobs() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url());
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    let c = client();
    let (first, _) = submit(&c, &a, HELD, "").await;
    up.wait_current(ROUTE, 1).await;
    let mut queued = vec![];
    for _ in 0..3 {
        queued.push(submit(&c, &b, ROUTE, "").await.0);
    }
    let series = |state: &str| format!("tollgate_jobs{{route=\"{ROUTE}\",state=\"{state}\"}}");
    for gw in [&a, &b] {
        wait_metric(gw, &series("queued"), 3.0, Duration::from_secs(3)).await;
    }
    assert_metric(&a, &series("running"), 1.0).await;
    assert_metric(&b, &series("running"), 0.0).await;
    let routes: serde_json::Value = reqwest::get(b.admin("/admin/routes"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let route = route_entry(&routes, ROUTE);
    assert_eq!(
        route["jobs"],
        serde_json::json!({"queued": 3, "running": 0})
    );
    for location in std::iter::once(&first).chain(&queued) {
        assert_eq!(result(&c, &b, location).await.status(), 200);
    }
    for gw in [&a, &b] {
        wait_metric(gw, &series("queued"), 0.0, Duration::from_secs(3)).await;
        wait_metric(gw, &series("running"), 0.0, Duration::from_secs(3)).await;
    }
}

/// A plan's `max_in_flight_per_key` counts a fleet job from submission to its end, as on the
/// memory store: a key at its cap gets 429 `concurrency-limit` (no job, not charged), on any
/// instance; a job that ends (done, or cancelled while queued) frees the key's slot.
#[tokio::test]
async fn a_plans_max_in_flight_per_key_counts_jobs_from_submission_to_their_end() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url())
        .replace(
            "keys:\n",
            "plans:\n  two: {max_cost: 100, window: 24h, max_in_flight_per_key: 2}\nkeys:\n",
        )
        .replace(&registry_key("a", ""), &registry_key("a", ", plan: two"));
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    let c = client();
    let (running, _) = submit(&c, &a, HELD, "").await;
    up.wait_current(ROUTE, 1).await;
    let (queued, _) = submit(&c, &b, ROUTE, "").await;
    for gw in [&a, &b] {
        let r = post_async(&c, gw.url(ROUTE), "key-a", "", &[]).await;
        assert_eq!(r.status(), 429);
        let p: serde_json::Value = r.json().await.unwrap();
        assert!(
            p["type"].as_str().unwrap().ends_with("concurrency-limit"),
            "{p}"
        );
    }
    assert_eq!(remaining(&a, "a").await, 80, "refusals are not charged");
    // Cancelling the queued job frees one of the key's slots.
    let cancelled = c
        .delete(a.url(&queued))
        .header("X-API-Key", "key-a")
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let (third, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(result(&c, &b, &running).await.status(), 200);
    assert_eq!(result(&c, &b, &third).await.status(), 200);
    // Both ended: the key's two slots are free again (a runner frees them after it wrote the
    // result, and counts the job running until then).
    for gw in [&a, &b] {
        let running = format!("tollgate_jobs{{route=\"{ROUTE}\",state=\"running\"}}");
        wait_metric(gw, &running, 0.0, Duration::from_secs(10)).await;
    }
    let (fourth, _) = submit(&c, &b, ROUTE, "").await;
    let (fifth, _) = submit(&c, &a, ROUTE, "").await;
    for location in [&fourth, &fifth] {
        assert_eq!(result(&c, &a, location).await.status(), 200);
    }
    assert_eq!(up.count(ROUTE), 4);
}

/// A route's `max_queue` refuses a job beyond it with 503 `route-busy`, not charged.
#[tokio::test]
async fn a_job_refused_by_a_full_queue_is_not_charged() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(200));
    let body = config(&redis.url()).replace(
        "max_in_flight: 1\n",
        "max_in_flight: 1\n      max_queue: 1\n",
    );
    assert!(body.contains("max_queue: 1"));
    let gw = Gateway::start(&up, &body);
    let c = client();
    let (first, _) = submit(&c, &gw, HELD, "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &gw, ROUTE, "").await;
    // Said and counted as the full queue it was (it was told "no slot freed within 0 ms" and
    // counted as `in_flight`: a job has no queue_timeout), at once.
    refused_at_once_by_a_full_queue(&gw, "key-a").await;
    assert_eq!(remaining(&gw, "a").await, 80);
    for location in [&first, &second] {
        assert_eq!(result(&c, &gw, location).await.status(), 200);
    }
    assert_eq!(remaining(&gw, "a").await, 80);
}

/// A slot a job frees goes to the next queued job at once (DESIGN §8: the waiter is woken
/// within 50 ms of the release): the fleet takes a grant when Redis publishes it, not at its
/// next collecting round. Ten jobs through a cap of 1, each 100 ms at the upstream, arrive
/// there one after the other: the median gap between two arrivals is within 100 + 50 ms (by
/// collecting rounds alone it would be ~200 ms). The median, measured at the upstream: a
/// loaded machine may delay a submission or two, not the hand-offs as a rule.
#[tokio::test]
async fn a_freed_slot_goes_to_the_next_job_at_once() {
    let redis = Redis::start();
    const EACH: Duration = Duration::from_millis(100);
    let up = Upstream::start(EACH);
    let body = config(&redis.url()).replace("max_cost: 100}", "max_cost: 1000}");
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    let c = client();
    let start = Instant::now();
    let mut jobs = vec![];
    for i in 0..10 {
        jobs.push(
            submit(&c, if i % 2 == 0 { &a } else { &b }, ROUTE, "")
                .await
                .0,
        );
    }
    let last = jobs.last().unwrap();
    loop {
        let r = get(&c, a.url(last), "key-a").await;
        if r.status() != 202 {
            assert_eq!(r.status(), 200);
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "never done");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(up.count(ROUTE), 10);
    assert_eq!(up.max_concurrent(ROUTE), 1);
    let arrivals = up.arrivals(ROUTE);
    let mut gaps: Vec<Duration> = arrivals.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    assert_eq!(gaps.len(), 9);
    assert!(
        gaps[4] < EACH + Duration::from_millis(50),
        "jobs of {EACH:?} through a cap of 1 arrived at the upstream {gaps:?} apart"
    );
}

/// On Redis as on the memory store, a submission is decided before its body is read (DESIGN
/// §8): a key at its plan's `max_in_flight_per_key`, or over budget, gets its 429 at once
/// while it waits for `100 Continue`; a body that then stalls is 408, its charge and its key's
/// slot given back (no job, and the upstream never had it), with every rate-limit header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_submission_is_decided_before_its_body_and_given_back_if_it_stalls() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(3));
    let body = config(&redis.url())
        .replace(
            "keys:\n",
            "plans:\n  one: {max_cost: 100, window: 24h, max_in_flight_per_key: 1}\nkeys:\n",
        )
        .replace(&registry_key("a", ""), &registry_key("a", ", plan: one"))
        .replace("  endpoints:\n", "  endpoints:\n    /huge: {cost: 100}\n");
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        server_extra: "  body_timeout: 2s\n",
        ..GatewayOpts::default()
    });
    let port = gw.port;
    let head = |key: &str, extra: &str| {
        format!(
            "POST /reports/generate HTTP/1.1\r\nHost: localhost\r\nX-API-Key: {key}\r\nPrefer: respond-async\r\n{extra}\r\n"
        )
    };
    let expect = "Expect: 100-continue\r\nContent-Length: 3\r\n";
    // Key a's body stalls: 408, nothing charged, its key's slot free again.
    let stalled = head("key-a", "Content-Length: 100\r\n") + "abc";
    let r = tokio::task::spawn_blocking(move || raw_request(port, stalled.as_bytes()))
        .await
        .unwrap()
        .expect("an answer");
    assert_eq!(r.status, 408, "{r:?}");
    assert!(r.is_problem("request-timeout"), "{r:?}");
    assert_eq!(r.header("ratelimit"), Some("\"one\";r=100;t=0"));
    assert_eq!(
        (
            r.header("x-ratelimit-remaining"),
            r.header("x-ratelimit-reset"),
            r.header("x-ratelimit-cost")
        ),
        (Some("100"), Some("0"), Some("0"))
    );
    assert_eq!(remaining(&gw, "a").await, 100);
    // Its slot is free: the next submission is told to send its body, and becomes a job.
    let (ha, hb) = (head("key-a", expect), head("key-b", expect));
    let accepted = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut s = raw_connect(port);
        s.write_all(ha.as_bytes()).unwrap();
        assert_eq!(read_interim(&mut s), Some(100));
        s.write_all(b"abc").unwrap();
        let accepted = read_raw_response(&mut s).expect("an answer");
        // While that job holds key a's one slot: 429 at once, no 100 Continue.
        let mut s = raw_connect(port);
        s.write_all(ha.as_bytes()).unwrap();
        let busy = read_raw_response(&mut s).expect("an answer");
        assert_eq!(busy.status, 429, "{busy:?}");
        assert!(busy.is_problem("concurrency-limit"), "{busy:?}");
        accepted
    })
    .await
    .unwrap();
    assert_eq!(accepted.status, 202, "{accepted:?}");
    assert_eq!(accepted.header("x-ratelimit-cost"), Some("10"));
    let c = client();
    let location = accepted.header("location").unwrap().to_string();
    assert_eq!(result(&c, &gw, &location).await.status(), 200);
    assert_eq!(remaining(&gw, "a").await, 90);
    // Key b, its budget spent: 429 `quota-exceeded` at once, with Retry-After.
    assert_eq!(post(&c, gw.url("/huge"), "key-b").await.status(), 200);
    let refused = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut s = raw_connect(port);
        let asked = Instant::now();
        s.write_all(hb.as_bytes()).unwrap();
        (
            read_raw_response(&mut s).expect("an answer"),
            asked.elapsed(),
        )
    });
    let (r, after) = refused.await.unwrap();
    assert_eq!(r.status, 429, "after {after:?}: {r:?}");
    assert!(r.is_problem("quota-exceeded"), "{r:?}");
    assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() > 0);
    // At once, not after body_timeout (2 s), as a 408 came.
    assert!(after < Duration::from_secs(2), "answered after {after:?}");
    assert_eq!(remaining(&gw, "b").await, 0);
    assert_eq!(up.count(ROUTE), 1);
}

/// Runs `lua/jobs.lua` on record `id` with `args` (its operation first): redis-cli's reply,
/// its words joined by single spaces.
fn job_op(redis: &Redis, id: &str, args: &[&str]) -> String {
    let script = include_str!("../src/store/lua/jobs.lua");
    let mut all = vec!["EVAL", script, "1", id];
    all.extend_from_slice(args);
    redis
        .cli(&all)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `lua/jobs.lua`'s `finish` answers a resend of the run's own finish as it answered the first
/// (its reply may have been lost with the connection), and a job declared lost as not the
/// run's: the runner sends a failed write again without counting a job twice.
#[test]
fn a_finish_sent_again_is_the_runs_own() {
    let redis = Redis::start();
    let finish = |id: &str, state: &str| job_op(&redis, id, &["finish", state, "status", "200"]);
    redis.cli(&["HSET", "t:j:one", "state", "running", "ttl", "60000"]);
    assert_eq!(finish("t:j:one", "done"), "1");
    assert_eq!(finish("t:j:one", "done"), "1", "a resend");
    assert_eq!(redis.cli(&["HGET", "t:j:one", "state"]).trim(), "done");
    redis.cli(&[
        "HSET", "t:j:lost", "state", "failed", "lost", "1", "ttl", "60000",
    ]);
    assert_eq!(finish("t:j:lost", "failed"), "0", "declared lost");
    redis.cli(&[
        "HSET",
        "t:j:cancelled",
        "state",
        "cancelled",
        "ttl",
        "60000",
    ]);
    assert_eq!(finish("t:j:cancelled", "done"), "0");
}

/// `lua/jobs.lua`'s `claim` takes a resend with the claim's own token for the same claim (its
/// answer was lost), and nothing else: another token finds the job running (`{3}`), and once
/// the run has ended even the same token gets `{0}` (DESIGN §8: a job runs at most once).
#[test]
fn a_claim_sent_again_with_its_token_is_the_same_claim() {
    let redis = Redis::start();
    let claim = |token: &str| job_op(&redis, "t:j:one", &["claim", "gw-a", "60000", token]);
    redis.cli(&["HSET", "t:j:one", "state", "queued", "ttl", "60000"]);
    // Submitted now (by Redis's clock): due at once, not overdue.
    let secs: u64 = redis
        .cli(&["TIME"])
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let sub = (secs * 1000).to_string();
    redis.cli(&["HSET", "t:j:one", "sub", &sub, "delay", "0"]);
    assert_eq!(claim("t1"), "1 0");
    assert_eq!(claim("t1"), "1 0", "the same claim, sent again");
    assert_eq!(
        claim("t2"),
        "3",
        "another claim: it runs, its runner vouches for it"
    );
    assert_eq!(claim(""), "3", "a claim without a token");
    job_op(&redis, "t:j:one", &["finish", "done", "status", "200"]);
    assert_eq!(claim("t1"), "0", "its run has ended");
}

/// `lua/jobs.lua`'s `claim` that found a job past its `result_ttl` (and expired it) says so
/// again when sent again with its token: its caller, whose first answer was lost, still
/// refunds it. (Before, the resend found it `expired` and answered `{0}`, "gone": nobody
/// refunded a job that never ran.) Another token still finds it gone.
#[test]
fn a_claim_that_expired_a_job_says_so_again_when_sent_again() {
    let redis = Redis::start();
    let claim = |token: &str| job_op(&redis, "t:j:one", &["claim", "gw-a", "60000", token]);
    // Submitted at the epoch's first second (by Redis's clock): long past its 1 s ttl.
    redis.cli(&[
        "HSET", "t:j:one", "state", "queued", "ttl", "1000", "sub", "1000", "delay", "0",
    ]);
    assert_eq!(claim("t1"), "2");
    assert_eq!(redis.cli(&["HGET", "t:j:one", "state"]).trim(), "expired");
    assert_eq!(claim("t1"), "2", "the same claim, sent again");
    assert_eq!(claim("t2"), "0", "another claim");
    assert_eq!(claim(""), "0", "a claim without a token");
    // Read as expired for its 1 s ttl, then as gone; but kept for the claim's resends (up to
    // half its alive_ms), which still find what the claim did.
    assert!(job_op(&redis, "t:j:one", &["get"]).contains("state expired"));
    let pttl: u64 = redis.cli(&["PTTL", "t:j:one"]).trim().parse().unwrap();
    assert!((30_000..=60_000).contains(&pttl), "{pttl}");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(job_op(&redis, "t:j:one", &["get"]), "", "gone");
    assert_eq!(claim("t1"), "2", "sent again past its ttl");
    // Its claimer reads what it was charged, to refund it.
    let kept = job_op(&redis, "t:j:one", &["get", "kept"]);
    assert!(kept.contains("state expired"), "{kept}");
}

/// `lua/jobs.lua`'s `claim` and `renew` keep a running job's record at least its `ttl` past
/// its runner's word for it (and never shorten it): a run longer than the life its record
/// was given at submission (twice `result_ttl` and a minute) is still read, and finished.
#[test]
fn a_running_jobs_record_outlives_its_runners_word() {
    let redis = Redis::start();
    let pttl = || -> i64 { redis.cli(&["PTTL", "t:j:one"]).trim().parse().unwrap() };
    redis.cli(&[
        "HSET", "t:j:one", "state", "queued", "ttl", "30000", "sub", "1000", "delay", "0",
    ]);
    // Not yet overdue by its ttl: submitted now.
    let now = redis.cli(&["TIME"]);
    let secs = now.split_whitespace().next().unwrap();
    redis.cli(&["HSET", "t:j:one", "sub", &format!("{secs}000")]);
    redis.cli(&["PEXPIRE", "t:j:one", "500"]);
    let claimed = job_op(&redis, "t:j:one", &["claim", "gw-a", "10000", "t1"]);
    assert_eq!(claimed.split_whitespace().next(), Some("1"), "{claimed}");
    assert!((20_000..=40_000).contains(&pttl()), "{}", pttl());
    redis.cli(&["PEXPIRE", "t:j:one", "500"]);
    assert_eq!(job_op(&redis, "t:j:one", &["renew", "20000"]), "1");
    assert!((40_000..=50_000).contains(&pttl()), "{}", pttl());
    redis.cli(&["PEXPIRE", "t:j:one", "900000"]);
    job_op(&redis, "t:j:one", &["renew", "20000"]);
    assert!(pttl() > 800_000, "not shortened: {}", pttl());
}

/// A job that runs past the life its record was given at submission still ends with its
/// answer: its record near its end (as after a `result_ttl` of seconds and a run of minutes:
/// here set so by hand) is kept on by the runner's renewals. (Before, the record expired
/// mid-run: its polls found no job, 404, and the upstream's 200 was never stored.)
#[tokio::test]
async fn a_job_running_past_its_records_life_keeps_its_answer() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    let (location, _) = submit(&c, &a, "/reports/generate?delay_ms=6000", "").await;
    up.wait_current(ROUTE, 1).await;
    let id = location.rsplit('/').next().unwrap();
    // Three renewals' time (a third of lease_ttl each) and some; the run, twice as long.
    assert_eq!(
        redis.cli(&["PEXPIRE", &format!("t:j:{id}"), "2500"]).trim(),
        "1"
    );
    ran_once_charged_once(&c, &a, &up, &location).await;
}

/// `lua/jobs.lua`'s `cancel` and `expire` take a resend with the token of the call that took
/// the job out of its queue for that call (its answer was lost: its caller refunds it), and
/// nothing else.
#[test]
fn a_take_out_sent_again_with_its_token_is_the_same() {
    let redis = Redis::start();
    let call = |id: &str, op: &str, token: &str| job_op(&redis, id, &[op, token]);
    for op in ["cancel", "expire"] {
        let id = format!("t:j:{op}");
        // Submitted at the epoch's first second: long past its 1 s ttl.
        redis.cli(&[
            "HSET", &id, "state", "queued", "ttl", "1000", "sub", "1000", "delay", "0",
        ]);
        assert_eq!(call(&id, op, "t1"), "1", "{op}");
        assert_eq!(call(&id, op, "t1"), "1", "{op}: the same call, sent again");
        assert_eq!(call(&id, op, "t2"), "0", "{op}: another call");
        assert_eq!(call(&id, op, ""), "0", "{op}: a call without a token");
        let other = if op == "cancel" { "expire" } else { "cancel" };
        assert_eq!(call(&id, other, "t1"), "0", "{op}: {other} with its token");
        // Kept for its resends (a minute after a cancel, 10 s after an expiry), whatever
        // its 1 s ttl.
        let pttl: u64 = redis.cli(&["PTTL", &id]).trim().parse().unwrap();
        assert!(pttl > 5_000, "{op}: {pttl}");
    }
}

/// A `DELETE` whose cancel Redis runs but answers past `store.timeout` (the call is held on
/// its way there for a second) still cancels the job and refunds it, once: the cancel is sent
/// again with its token. (Before, the gateway answered 409 "started", though the job was
/// cancelled all the same, and its charge was never given back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_answered_late_still_cancels_and_refunds_once() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_millis(2000));
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    let (first, _) = submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(remaining(&b, "a").await, 80);
    proxy.hold_matching("\r\ncancel\r\n");
    let delete = c.delete(b.url(&second)).header("X-API-Key", "key-a").send();
    let (cancelled, ()) = tokio::join!(delete, async {
        // Held from its first try for a second: well past store.timeout (its resends go on
        // for 2 s, held too).
        eventually(Duration::from_secs(10), async || match proxy.held() {
            0 => Err("no cancel sent yet".to_string()),
            _ => Ok(()),
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        proxy.heal();
    });
    let cancelled = cancelled.unwrap();
    assert_eq!(cancelled.status(), 200, "{:?}", cancelled.text().await);
    assert!(
        proxy.delivered_late() >= 2,
        "the cancel and its resend held"
    );
    assert_eq!(remaining(&b, "a").await, 90);
    assert_metric(
        &b,
        "tollgate_jobs_total{result=\"cancelled\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    assert_eq!(result(&c, &a, &first).await.status(), 200);
    let (third, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(result(&c, &a, &third).await.status(), 200);
    assert_eq!(up.count(ROUTE), 2, "the cancelled job never ran");
    assert_eq!(remaining(&b, "a").await, 80);
}

/// Two `DELETE`s of one queued job on two gateways: one cancels it (200, refunded once), and
/// the other, whose cancel comes second, finds it gone: 404, as a poll of a cancelled job is.
/// (Before, the second was 409 "the job has started", for a job that never runs.) B's cancel
/// is held on its way to Redis until A's has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_of_two_deletes_of_a_job_finds_it_gone() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_millis(3000));
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    let (first, _) = submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, ROUTE, "").await;
    let delete = |gw: &Gateway| {
        c.delete(gw.url(&second))
            .header("X-API-Key", "key-a")
            .send()
    };
    proxy.hold_matching("\r\ncancel\r\n");
    let (on_b, on_a) = tokio::join!(delete(&b), async {
        eventually(Duration::from_secs(10), async || match proxy.held() {
            0 => Err("B's cancel not sent yet".to_string()),
            _ => Ok(()),
        })
        .await;
        let on_a = delete(&a).await.unwrap();
        proxy.heal();
        on_a
    });
    assert_eq!(on_a.status(), 200);
    let on_b = on_b.unwrap();
    assert_eq!(on_b.status(), 404, "{:?}", on_b.text().await);
    assert_eq!(remaining(&a, "a").await, 90);
    assert_eq!(result(&c, &a, &first).await.status(), 200);
    assert_eq!(up.count(ROUTE), 1);
}

/// A `DELETE` whose cancel Redis never answers is 503 `store-unavailable` with
/// `Retry-After: 1`, after its resends (2 s), never a hang: the job may or may not be
/// cancelled. (Before, it was 409 "the job has started", for a job still queued.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_redis_does_not_answer_is_503_not_409() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_millis(5000));
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    submit(&c, &a, ROUTE, "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, ROUTE, "").await;
    proxy.hold_matching("\r\ncancel\r\n");
    let asked = Instant::now();
    let r = c
        .delete(b.url(&second))
        .header("X-API-Key", "key-a")
        .send()
        .await
        .unwrap();
    let took = asked.elapsed();
    assert_eq!(r.status(), 503, "{:?}", r.text().await);
    assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["type"].as_str().unwrap().ends_with("store-unavailable"),
        "{p}"
    );
    // Not a hang: its resends' 2 s, and room for a loaded machine.
    assert!(took < Duration::from_secs(10), "{took:?}");
    proxy.heal();
}

/// A queued job past its `result_ttl` whose expiry by the collectors' look Redis runs but
/// answers late (held on its way there for 300 ms) is still refunded, once, polled or not:
/// the expiry is sent again with its token. (Before, it ended `expired` with its charge kept,
/// for a job that never ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_jobs_expiry_answered_late_is_still_refunded() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_millis(4000));
    let a = Gateway::start(&up, &config_kept(&proxy.url(), "2s"));
    let c = client();
    proxy.hold_matching("\r\nexpire\r\n");
    let sync = tokio::spawn({
        let (c, url) = (c.clone(), a.url(ROUTE));
        async move { post(&c, url, "key-a").await.status() }
    });
    up.wait_current(ROUTE, 1).await;
    let (location, _) = submit(&c, &a, ROUTE, "").await;
    let overdue = Instant::now() + Duration::from_millis(2500);
    eventually(Duration::from_secs(10), async || match proxy.held() {
        0 => Err("no expiry sent yet".to_string()),
        _ => Ok(()),
    })
    .await;
    // Delivered once the job is past its result_ttl (2 s) for sure, 300 ms after it was held
    // at least: it runs then, and expires the job, answered past store.timeout.
    tokio::time::sleep_until(
        overdue
            .max(Instant::now() + Duration::from_millis(300))
            .into(),
    )
    .await;
    proxy.heal();
    eventually(Duration::from_secs(5), async || {
        match remaining(&a, "a").await {
            90 => Ok(()),
            n => Err(format!("remaining {n}")),
        }
    })
    .await;
    let expired = result(&c, &a, &location).await;
    assert_eq!(expired.status(), 503);
    assert_metric(
        &a,
        "tollgate_jobs_total{result=\"expired\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    assert_eq!(sync.await.unwrap(), 200);
    assert_eq!(up.count(ROUTE), 1);
    assert_eq!(remaining(&a, "a").await, 90);
}

/// A queued job is given back and settled at what it was charged, whatever a reload changed
/// since: charged 10, its route's cost reloaded to 40, a cancel gives 10 back (it gave 40) and
/// the job that runs stays charged 10 (it was settled to 40); its route's `async:` then
/// removed, a cancel still gives its 10 back (it gave nothing: the route was not async).
#[tokio::test]
async fn a_queued_jobs_charge_is_what_it_was_charged_across_reloads() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    // Running 10 s: through both reloads and cancels, however slow the machine.
    let (first, _) = submit(&c, &a, "/reports/generate?delay_ms=10000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, ROUTE, "").await;
    let (third, _) = submit(&c, &a, ROUTE, "").await;
    assert_eq!(remaining(&a, "a").await, 70);
    let delete = |location: &str| {
        c.delete(a.url(location))
            .header("X-API-Key", "key-a")
            .send()
    };
    a.edit_config("      cost: 10\n", "      cost: 40\n");
    a.reload(0.0).await;
    assert_eq!(delete(&second).await.unwrap().status(), 200);
    assert_eq!(
        remaining(&a, "a").await,
        80,
        "the cancel gave back what was charged"
    );
    a.edit_config("      async:\n        result_ttl: 30s\n", "");
    a.reload(1.0).await;
    assert_eq!(delete(&third).await.unwrap().status(), 200);
    assert_eq!(
        remaining(&a, "a").await,
        90,
        "given back without its route's async"
    );
    assert_eq!(result(&c, &a, &first).await.status(), 200);
    let line = job_end_line(&a, &first, "job_done").await;
    assert_eq!(line["cost"].as_u64(), Some(10), "{line}");
    assert_eq!(
        remaining(&a, "a").await,
        90,
        "the job that ran stays charged what it was"
    );
    assert_eq!(up.count(ROUTE), 1);
}

/// Jobs queued before a reload took their route away, or its `async:`, still run, as their
/// route was when they were accepted (DESIGN §8: "a queued job still runs"): the instance
/// that knew the route collects its queue until it is empty. (They were stranded in the
/// queue: their slots were never collected, so they never ran, and their polls said `queued`
/// until `result_ttl`, then 503.)
async fn queued_jobs_run_after_a_reload(edits: &[(&str, &str)]) {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // The route's upstream is a named one, which a reload may take away with it.
    let body = config(&redis.url()).replacen(
        "      cost: 10\n",
        "      cost: 10\n      upstream: reports\n",
        1,
    );
    let body = format!("upstreams:\n  reports: {{url: \"{}\"}}\n{body}", up.url());
    let a = Gateway::start(&up, &body);
    let c = client();
    // Running 3 s: through the reload, however slow the machine.
    let (first, _) = submit(&c, &a, "/reports/generate?delay_ms=3000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, "/reports/generate?n=2", "").await;
    let (third, _) = submit(&c, &a, "/reports/generate?n=3", "").await;
    assert_eq!(remaining(&a, "a").await, 70);
    for (from, to) in edits {
        a.edit_config(from, to);
    }
    a.reload(0.0).await;
    for location in [&first, &second, &third] {
        assert_eq!(result(&c, &a, location).await.status(), 200, "{location}");
    }
    assert_eq!(up.count(ROUTE), 3);
    assert_eq!(
        remaining(&a, "a").await,
        70,
        "each stays charged what it was"
    );
}

#[tokio::test]
async fn jobs_queued_before_a_reload_takes_their_route_away_still_run() {
    // The route and its named upstream both go.
    queued_jobs_run_after_a_reload(&[
        (&format!("    {ROUTE}:\n"), "    /elsewhere:\n"),
        ("      upstream: reports\n", ""),
        ("upstreams:\n  reports:", "upstreams:\n  others:"),
    ])
    .await;
}

#[tokio::test]
async fn jobs_queued_before_a_reload_takes_their_routes_async_away_still_run() {
    queued_jobs_run_after_a_reload(&[("      async:\n        result_ttl: 30s\n", "")]).await;
}

/// The fleet's collectors keep its jobs alive in the route's queue: a backlog that outlasts
/// the 30 s the last submission marked the fleet alive for still runs, one job after another
/// as the slot frees. (Only a submission marked it: 30 s after the last one, the queue passed
/// its jobs over, and they waited with the slot idle until `result_ttl`.) The 30 s are made to
/// have passed by setting the mark in the past.
#[tokio::test]
async fn a_backlog_of_jobs_runs_on_after_the_last_submission_is_long_past() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    // Running 3 s: the mark is moved while it runs.
    let (first, _) = submit(&c, &a, "/reports/generate?delay_ms=3000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (second, _) = submit(&c, &a, "/reports/generate?n=2", "").await;
    let keys = redis.cli(&["KEYS", "*"]);
    let states: Vec<&str> = keys
        .lines()
        .filter(|k| redis.cli(&["HEXISTS", k, "i:jobs"]) == "1")
        .collect();
    assert_eq!(states.len(), 1, "{keys}");
    assert_eq!(redis.cli(&["HSET", states[0], "i:jobs", "0"]), "0");
    for location in [&first, &second] {
        assert_eq!(result(&c, &a, location).await.status(), 200, "{location}");
    }
    assert_eq!(up.count(ROUTE), 2);
}

/// A queued job that has waited `result_ttl` is expired and refunded when it is due, whether
/// or not anyone polls it (DESIGN §8; the memory store's job does so itself): the fleet's
/// collectors look at each route's oldest queued jobs now and then. (It was expired only at a
/// poll or when its slot came: behind a long backlog, or never polled, it stayed charged, and
/// once its record lapsed the charge stayed for good.)
#[tokio::test]
async fn a_queued_job_past_its_result_ttl_is_refunded_unpolled() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config_kept(&redis.url(), "2s"));
    let c = client();
    // Holds the slot for 12 s: the queued job's 2 s pass long before.
    submit(&c, &a, "/reports/generate?delay_ms=12000", "").await;
    up.wait_current(ROUTE, 1).await;
    submit(&c, &a, ROUTE, "").await;
    assert_eq!(remaining(&a, "a").await, 80);
    let start = std::time::Instant::now();
    while remaining(&a, "a").await != 90 {
        assert!(
            start.elapsed() < Duration::from_secs(9),
            "the expired job was not refunded while the slot stayed taken"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let line = a.wait_access(1, |l| l["decision"] == "job_expired").await;
    assert_eq!(line.len(), 1, "{line:?}");
    assert_eq!(up.count(ROUTE), 1);
}

/// Redis stalls for longer than `lease_ttl` while a job runs on a cap of 1 and another
/// waits: by Redis's clock the running job's lease lapsed, but nobody could renew it. Once
/// Redis answers, the lease is kept for its runner to renew instead of going to the waiting
/// job: the second job runs after the first, never beside it, and both end 200. (Before, the
/// first beat Redis ran after the stall granted the slot to the waiting job.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_stall_past_lease_ttl_gives_no_running_jobs_slot_away() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(100));
    let body = config(&redis.url());
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let (running, _) = submit(&c, &a, "/reports/generate?delay_ms=6000", "").await;
    up.wait_current(ROUTE, 1).await;
    let (waiting, _) = submit_as(&c, &b, ROUTE, "", "key-b").await;
    redis.pause();
    // Past the lease (2 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    redis.resume();
    // No poll until the second job reached the upstream (a poll that finds the first job's
    // record unrenewed would take it for lost: not this test's matter).
    eventually(Duration::from_secs(15), async || match up.count(ROUTE) {
        2 => Ok(()),
        n => Err(format!("{n} at the upstream")),
    })
    .await;
    assert_eq!(
        up.max_concurrent(ROUTE),
        1,
        "the waiting job ran beside the running one\n{}\n{}",
        a.log(),
        b.log()
    );
    assert_eq!(result(&c, &b, &running).await.status(), 200);
    assert_eq!(result_as(&c, &a, &waiting, "key-b").await.status(), 200);
    assert_eq!(up.count(ROUTE), 2);
}

/// Redis is silent for longer than `lease_ttl` while a job runs and its client polls: by
/// Redis's clock its runner's word for it lapsed, but the runner did not stop (DESIGN §8 loses
/// the job of an instance that dies). A poller that just saw Redis fail leaves the runner time
/// to renew: here the runner, A, is cut off from Redis a moment longer, and B's first answer
/// after the silence is still "running"; A renews, the job ends 200, run once. (Before, that
/// first read declared the job lost: 502 `job-lost`, the upstream's 200 thrown away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_silence_past_lease_ttl_loses_no_running_job() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&proxy.url()));
    let b = Gateway::start(&up, &config(&redis.url()));
    let c = client();
    // A slot is free: A runs the job it accepts.
    let (location, _) = submit(&c, &a, "/reports/generate?delay_ms=7000", "").await;
    up.wait_current(ROUTE, 1).await;
    assert_eq!(get(&c, b.url(&location), "key-a").await.status(), 202);
    proxy.blackhole();
    redis.pause();
    let paused = Instant::now();
    // Polled on B through the silence, past the lease (2 s): 503 while Redis does not answer.
    while paused.elapsed() < LEASE_TTL + Duration::from_secs(1) {
        let r = get(&c, b.url(&location), "key-a").await;
        assert_eq!(r.status(), 503, "{:?}", r.text().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis.resume();
    let first = loop {
        let r = get(&c, b.url(&location), "key-a").await;
        match r.status().as_u16() {
            503 => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => break r,
        }
    };
    assert_eq!(
        first.status(),
        202,
        "B's first answer after the silence, A still cut off: {:?}",
        first.text().await
    );
    proxy.heal();
    let done = result(&c, &b, &location).await;
    assert_eq!(done.status(), 200, "{}\n{}", a.log(), b.log());
    assert_eq!(up.count(ROUTE), 1);
}

/// A job that ends while Redis is silent for three leases keeps its upstream's answer: its
/// runner goes on vouching for it and sends its result again until Redis takes it. (Before,
/// the runner gave up on the write after about two leases and stopped vouching for the job,
/// and the first reads after the silence ended it `job-lost`, 502, the upstream's 200 thrown
/// away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ends_during_a_long_redis_silence_keeps_its_answer() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = config(&redis.url());
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    // A slot is free: A runs the job it accepts; it ends 1 s into the silence.
    let (location, _) = submit(&c, &a, "/reports/generate?delay_ms=1500", "").await;
    up.wait_current(ROUTE, 1).await;
    redis.pause();
    tokio::time::sleep(LEASE_TTL * 3).await;
    redis.resume();
    let done = result(&c, &b, &location).await;
    assert_eq!(done.status(), 200, "{:?}\n{}", done.text().await, a.log());
    assert_eq!(up.count(ROUTE), 1);
    assert_eq!(job_end_line(&a, &location, "job_done").await["status"], 200);
}

/// A dead runner's job is declared lost also by an instance whose way to Redis keeps failing
/// now and then (it never goes the 3 s + lease_ttl/4 without a silence that lets it declare by
/// itself): once Redis first saw the runner's word lapsed that long ago, any read declares.
/// Here B's way to Redis is cut for 1.5 s of every 3 s while A, the runner, lies dead. (Before,
/// B's polls answered 202 `running` for as long as its failures went on.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_runners_job_is_lost_also_on_an_instance_whose_redis_fails_now_and_then() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let mut a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    // A slot is free: A runs the job it accepts.
    let (location, _) = submit(&c, &a, "/reports/generate?delay_ms=30000", "").await;
    up.wait_current(ROUTE, 1).await;
    a.kill9();
    let killed = Instant::now();
    let lost = loop {
        let cut = killed.elapsed().as_millis() % 3000 < 1500;
        if cut {
            proxy.blackhole();
        } else {
            proxy.heal();
        }
        let r = get(&c, b.url(&location), "key-a").await;
        match r.status().as_u16() {
            202 | 503 => {}
            _ => break r,
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "still running 20 s after its runner died\n{}",
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    proxy.heal();
    assert_eq!(lost.status(), 502);
    let p: serde_json::Value = lost.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("job-lost"), "{p}");
    assert_eq!(up.count(ROUTE), 1);
}

/// A job whose claim (the call that makes it its runner's) ran in Redis, but whose answer
/// came back after `store.timeout`, still runs: its runner sends the claim again, and Redis
/// takes the resend for the same claim. (Before, the runner took the unanswered claim for
/// failed and passed the slot on; the record said the job ran there, and a lease later it
/// ended `job-lost`, 502, charged, never sent upstream: the probe saw it in 8 of 8 runs with
/// the claim's reply held 0.3–0.5 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_claim_is_answered_late_still_runs() {
    runs_with_its_call_answered_late("\r\nclaim\r\n").await;
}

/// A claimed job whose first read of its record (its request) goes unanswered still runs:
/// the read is sent again. (Before, the runner gave the slot up at once; the claim had made
/// the job its own, so a lease later it ended `job-lost`, 502, charged, never sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_job_whose_record_is_read_late_still_runs() {
    runs_with_its_call_answered_late("\r\nget\r\n").await;
}

/// A job submitted to a gateway with a free slot (it claims the job, reads its record and
/// runs it) whose calls to Redis holding `needle` wait on their way there past
/// `store.timeout` (250 ms), for 450 ms: it ends 200, run once, charged once. (The first
/// call times out at 250 ms; the resend, at 350 ms, is answered at the heal, well within the
/// half lease, 1 s, that resends go on for.)
async fn runs_with_its_call_answered_late(needle: &str) {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    proxy.hold_matching(needle);
    let ((location, _), ()) = tokio::join!(submit(&c, &a, ROUTE, ""), async {
        tokio::time::sleep(Duration::from_millis(450)).await;
        proxy.heal();
    });
    ran_once_charged_once(&c, &a, &up, &location).await;
}

/// `lua/jobs.lua`'s `get` tells how long reads have found a running job's runner's word
/// lapsed, counting at most a second between two reads (Redis may have been silent between
/// them: a runner could not renew then); a renewal clears it.
#[test]
fn reads_count_a_lapse_at_most_a_second_between_two() {
    let redis = Redis::start();
    let lapsed = || -> Option<u64> {
        let out = job_op(&redis, "t:j:one", &["get"]);
        let words: Vec<&str> = out.split(' ').collect();
        let at = words.iter().position(|w| *w == "lapsed")?;
        Some(words[at + 1].parse().unwrap())
    };
    redis.cli(&[
        "HSET", "t:j:one", "state", "running", "alive", "1", "ttl", "60000",
    ]);
    assert_eq!(lapsed(), Some(0), "first found");
    std::thread::sleep(Duration::from_millis(1500));
    // Before the second read: its Redis time is later, so the gap to the third is within
    // what this clock reads at the end.
    let before = Instant::now();
    assert_eq!(lapsed(), Some(1000), "a second at most between two reads");
    std::thread::sleep(Duration::from_millis(200));
    let n = lapsed().unwrap();
    let most = 1000 + before.elapsed().as_millis() as u64 + 1;
    assert!((1200..=most).contains(&n), "{n}");
    job_op(&redis, "t:j:one", &["renew", "60000"]);
    assert_eq!(lapsed(), None, "renewed");
    redis.cli(&["HSET", "t:j:one", "alive", "1"]);
    assert_eq!(lapsed(), Some(0), "found lapsed again: counted afresh");
}

/// A job found lost by a poll whose answer never came back (its call timed out, and Redis ran
/// it later: a partition that delivered it late) is still counted and logged once. Its
/// runner, A, is paused past its lease; B's path to Redis holds B's call that declares it
/// lost (`lose`, after a read found its runner's word lapsed) until then. Before, only the
/// reader that made the job failed counted it, and that reader had given up: no `job_failed`
/// line and no `tollgate_jobs_total{result="failed"}` anywhere, although the job ended
/// `job-lost` for its client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_found_lost_by_a_poll_answered_late_is_counted_once() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &config(&redis.url()));
    let b = Gateway::start(&up, &config(&proxy.url()));
    let c = client();
    // A slot is free: A runs the job it accepts.
    let (location, _) = submit(&c, &a, "/reports/generate?delay_ms=5000", "").await;
    up.wait_current(ROUTE, 1).await;
    assert_eq!(get(&c, b.url(&location), "key-a").await.status(), 202);
    a.signal("STOP");
    // Past A's word for the job (lease_ttl, 2 s): B's next poll finds it lapsed, and its call
    // that declares the job lost waits on Redis; B gives up on it.
    tokio::time::sleep(LEASE_TTL + Duration::from_millis(500)).await;
    proxy.hold_matching("\r\nlose\r\n");
    let r = get(&c, b.url(&location), "key-a").await;
    assert_eq!(r.status(), 503, "{:?}", r.text().await);
    proxy.heal();
    // The held call has run in Redis (and found the job lost) before A renews anything.
    let id = location.rsplit('/').next().unwrap();
    let record = redis_job_key(id);
    let within = Duration::from_secs(5);
    redis
        .wait_cli(&["HGET", &record, "state"], "failed", within)
        .await;
    a.signal("CONT");
    let lost = result(&c, &b, &location).await;
    assert_eq!(lost.status(), 502);
    let p: serde_json::Value = lost.json().await.unwrap();
    assert!(p["type"].as_str().unwrap().ends_with("job-lost"), "{p}");
    const FAILED: &str = "tollgate_jobs_total{result=\"failed\",route=\"/reports/generate\"}";
    let counted = async || metric(&a, FAILED).await + metric(&b, FAILED).await;
    let lines = || {
        [&a, &b]
            .iter()
            .flat_map(|gw| gw.access_log())
            .filter(|l| l["decision"] == "job_failed")
            .count()
    };
    eventually(Duration::from_secs(10), async || match counted().await {
        1.0 => Ok(()),
        n => Err(format!("counted {n} times\n{}\n{}", a.log(), b.log())),
    })
    .await;
    // A's run ends after its upstream's 5 s: its refused result counts nothing again.
    up.wait_current(ROUTE, 0).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(counted().await, 1.0);
    assert_eq!(lines(), 1);
    assert_eq!(up.count(ROUTE), 1);
}

/// A job refused after its route's queue was asked whether it is full (`max_queue`: before
/// its body is read) leaves no key without a TTL behind: the route's queue state that the
/// question wrote (its cap and share) expires like every tollgate key (DESIGN §4: an evicting
/// policy could take tollgate's keys only because every one has a TTL). It stayed for good.
#[tokio::test]
async fn a_job_refused_after_asking_for_a_full_queue_leaves_no_key_without_a_ttl() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let keys: String = ["a"].iter().map(|id| registry_key(id, "")).collect();
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 250ms\n  on_error: deny\n  lease_ttl: 2s\n\
         rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    {ROUTE}:\n      cost: 10\n      max_in_flight: 1\n      max_queue: 5\n      async:\n        max_request_body: 16B\nkeys:\n{keys}",
        redis.url()
    );
    let gw = Gateway::start(&up, &body);
    let twenty = chunked(&["x".repeat(10), "y".repeat(10)]);
    let r = post_async_body(&client(), gw.url(ROUTE), "key-a", twenty, &[]).await;
    assert_eq!(r.status(), 413);
    let state = redis_route_queue_state_key(ROUTE);
    assert_eq!(redis.cli(&["EXISTS", &state]), "1", "the question wrote it");
    let ttl: i64 = redis.cli(&["PTTL", &state]).parse().unwrap();
    assert!(ttl > 0, "{state} has PTTL {ttl}");
}

/// A Redis stall shorter than `lease_ttl` while a job runs loses nothing: the runner
/// renews its lease again at once once Redis answers, so a poll meanwhile never finds it
/// lapsed. The runner renewed every third of `lease_ttl` and let a failed renewal go: two
/// missed in a row (the second refused by the breaker still open after the stall) left the
/// lease to lapse, the next poll declared the job lost (502 `job-lost`) while it ran, and
/// the upstream's 200 was thrown away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_redis_stall_while_a_job_runs_loses_nothing() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = config(&redis.url());
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let (running, _) = submit(&c, &a, "/reports/generate?delay_ms=4000", "").await;
    up.wait_current(ROUTE, 1).await;
    // From 0.3 s after the job's claim (its lease's last renewal) to 1.8 s, within the lease
    // (2 s), over two of its renewals' ticks (every 2/3 s). Both ends are set from one
    // reading of the clock, so that neither the pause's own time nor a late wake-up moves
    // the end towards the lease's: only the time from the claim to the upstream's count does.
    let claimed = tokio::time::Instant::now();
    tokio::time::sleep_until(claimed + Duration::from_millis(300)).await;
    redis.pause();
    tokio::time::sleep_until(claimed + Duration::from_millis(1800)).await;
    redis.resume();
    // Polled all along on the other gateway: never found lost.
    let done = loop {
        let r = get(&c, b.url(&running), "key-a").await;
        match r.status().as_u16() {
            202 | 503 => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => break r,
        }
    };
    assert_eq!(
        done.status(),
        200,
        "{}\n{}",
        a.log(),
        done.text().await.unwrap()
    );
    assert_eq!(up.count(ROUTE), 1);
}
