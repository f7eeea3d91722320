//! Several gateway processes, one real redis-server: the fleet shares one budget and one set of
//! in-flight slots, and survives Redis failures by the declared policy (DESIGN §4).

mod common;

use std::time::{Duration, Instant};

use common::*;

fn redis_body(redis: &Redis, on_error: &str, fleet_size: u32, rate_limits: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: {on_error}\n  fleet_size: {fleet_size}\n  lease_ttl: 2s\n{rate_limits}",
        redis.url()
    )
}

/// One gateway on `redis`, in front of `up`.
fn gateway_on(
    up: &Upstream,
    redis: &Redis,
    on_error: &str,
    fleet_size: u32,
    rate_limits: &str,
) -> Gateway {
    Gateway::start(up, &redis_body(redis, on_error, fleet_size, rate_limits))
}

fn fleet(up: &Upstream, n: usize, body: &str) -> Vec<Gateway> {
    (0..n).map(|_| Gateway::start(up, body)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn six_gateways_share_one_budget() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = redis_body(
        &redis,
        "local",
        6,
        "rate_limits:\n  default: {cost: 1, window: 1s, max_cost: 2}\n",
    );
    let gws = fleet(&up, 6, &body);
    let c = client();
    let start = Instant::now();
    let run_for = Duration::from_secs(4);
    let clients = gws.iter().map(|gw| {
        let c = c.clone();
        let url = gw.url("/items");
        async move {
            let (mut ok, mut limited) = (0u32, 0u32);
            while start.elapsed() < run_for {
                let r = get(&c, url.clone(), "the-one-key").await;
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => limited += 1,
                    s => panic!("status {s}"),
                }
                // Each worker of the incident sent as fast as its own limiter allowed.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (ok, limited)
        }
    });
    let results = futures_util::future::join_all(clients).await;
    let elapsed = start.elapsed().as_secs_f64();
    let admitted: u32 = results.iter().map(|r| r.0).sum();
    let limited: u32 = results.iter().map(|r| r.1).sum();
    let upstream = up.count("/items");
    assert_eq!(upstream, admitted as u64);
    // burst + rate × duration, for the whole fleet: not six times that.
    let bound = 2.0 + 2.0 * elapsed;
    assert!(
        (admitted as f64) <= bound.ceil(),
        "admitted {admitted} > {bound:.1} over {elapsed:.2}s"
    );
    assert!(
        admitted as f64 >= 2.0 * run_for.as_secs_f64() - 1.0,
        "the shared budget was usable: {admitted}"
    );
    assert!(limited > 100, "most requests were refused: {limited}");
    for gw in &gws {
        assert_eq!(metric(gw, "tollgate_store_degraded").await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_share_an_in_flight_cap() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(600));
    let limits = |queue: &str| {
        format!("rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 1000}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: 5{queue}}}\n")
    };
    async fn send_20(gws: &[Gateway]) -> Vec<u16> {
        let c = client();
        let rs = all_at_once(20, |i| {
            c.post(gws[i % 2].url("/reports/generate"))
                .header("X-API-Key", format!("k{i}"))
        })
        .await;
        let statuses = sorted_statuses(&rs);
        for r in rs.into_iter().filter(|r| r.status() == 503) {
            let v: serde_json::Value = r.json().await.unwrap();
            assert!(v["type"].as_str().unwrap().ends_with("route-busy"), "{v}");
        }
        statuses
    }
    // Without a queue: 5 run, 15 are told the route is busy.
    let gws = fleet(&up, 2, &redis_body(&redis, "deny", 2, &limits("")));
    let statuses = send_20(&gws).await;
    assert_eq!(statuses, [vec![200; 5], vec![503; 15]].concat());
    assert_eq!(up.max_concurrent("/reports/generate"), 5);
    drop(gws);

    // With a long enough queue: all 20 pass, never more than 5 at once.
    let up2 = Upstream::start(Duration::from_millis(300));
    let gws: Vec<Gateway> = (0..2)
        .map(|_| {
            Gateway::start(
                &up2,
                &redis_body(&redis, "deny", 2, &limits(", queue_timeout: 30s")),
            )
        })
        .collect();
    let statuses = send_20(&gws).await;
    assert_eq!(statuses, vec![200; 20]);
    assert!(up2.max_concurrent("/reports/generate") <= 5);
    assert_eq!(up2.count("/reports/generate"), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_gateways_slots_come_back_within_lease_ttl() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(20));
    let body = redis_body(
        &redis,
        "deny",
        2,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 1000}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 2}\n",
    );
    let mut a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    for i in 0..2 {
        let c = c.clone();
        let url = a.url("/reports/generate");
        tokio::spawn(async move {
            let _ = c
                .post(url)
                .header("X-API-Key", format!("a{i}"))
                .send()
                .await;
        });
    }
    up.wait_current("/reports/generate", 2).await;
    let r = post(&c, b.url("/reports/generate?delay_ms=10"), "b").await;
    assert_eq!(r.status(), 503, "A holds both slots");
    a.kill9();
    let killed = Instant::now();
    loop {
        let r = post(&c, b.url("/reports/generate?delay_ms=10"), "b").await;
        if r.status() == 200 {
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "slots of a dead instance did not come back within lease_ttl (2s) + slack"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let back = killed.elapsed();
    assert!(
        back >= Duration::from_millis(300),
        "came back too early: {back:?}"
    );
    eprintln!("slots returned {back:?} after SIGKILL (lease_ttl 2s)");
}

/// The same when nobody asks meanwhile: A holds both slots and is SIGKILLed, the route sees
/// no call for longer than the lease, and B's one request then finds a slot free at once
/// (200; no queue to wait in). A route that went silent because its holder died is not a
/// Redis stall (`lua/queue.lua`'s `wake`): its lapsed leases go.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_gateways_slots_are_free_after_a_quiet_lease_time() {
    free_after_a_quiet_lease_time(false).await;
}

/// And when the dead gateway left a waiter in the route's queue: a dead instance's waiter is
/// no sign that Redis, not the gateway, went silent. B's report, sent once A's lease lapsed
/// and nobody called meanwhile, takes the slot at once (a `queue_timeout` of 1 s: keeping the
/// lapsed lease for one more lease time, 2 s, would make it 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_gateways_slot_is_free_after_a_quiet_lease_time_despite_its_waiters() {
    free_after_a_quiet_lease_time(true).await;
}

/// A fills a cap of 2 (`waiter`: 1 and queues one more) and is SIGKILLed; 3.5 s later (the
/// lease, 2 s, and more, with no call on the route) B's one report is answered 200.
async fn free_after_a_quiet_lease_time(waiter: bool) {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(20));
    let (cap, queue) = if waiter {
        (1, ", queue_timeout: 1s")
    } else {
        (2, "")
    };
    let body = redis_body(
        &redis,
        "deny",
        2,
        &format!("rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 1000}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: {cap}{queue}}}\n"),
    );
    let mut a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let held: Vec<_> = (0..cap)
        .map(|i| spawn_post(&c, a.url("/reports/generate"), &format!("a{i}")))
        .collect();
    up.wait_current("/reports/generate", cap).await;
    if waiter {
        let _queued = spawn_post(&c, a.url("/reports/generate"), "a-waiting");
        let queued = r#"tollgate_queued{route="/reports/generate"}"#;
        wait_metric(&a, queued, 1.0, Duration::from_secs(1)).await;
    } else {
        let r = post(&c, b.url("/reports/generate?delay_ms=10"), "b").await;
        assert_eq!(r.status(), 503, "A holds both slots");
    }
    a.kill9();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let r = post(&c, b.url("/reports/generate?delay_ms=10"), "b").await;
    assert_eq!(r.status(), 200, "{}", b.log());
    drop(held);
}

/// DESIGN §4 and §8: a dead gateway's slot comes back within the lease time for its key's
/// share of the route too (`max_in_flight_per_key` on the endpoint). Its lease lapses, and the
/// route's lease set expires a second later; the queue's state outlives it and still counted
/// the key as running one: its next request waited out `queue_timeout` and got 503, every
/// time, until the state expired after a minute without calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_gateways_slot_comes_back_for_its_keys_share() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(20));
    let body = redis_body(
        &redis,
        "deny",
        2,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 1000}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 10, max_in_flight_per_key: 1, queue_timeout: 4s}\n",
    );
    let mut a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();
    let (c2, url) = (c.clone(), a.url("/reports/generate"));
    tokio::spawn(async move {
        // Its gateway is killed under it: no answer.
        let _ = c2.post(url).header("X-API-Key", "k").send().await;
    });
    up.wait_current("/reports/generate", 1).await;
    a.kill9();
    // The lease (2 s) lapsed and its set expired (a second after it).
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let sent = Instant::now();
    let r = post(&c, b.url("/reports/generate?delay_ms=10"), "k").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert!(
        sent.elapsed() < Duration::from_secs(2),
        "{:?}",
        sent.elapsed()
    );
    let v = admin_json(&b, "/admin/routes").await;
    assert!(!v.to_string().contains("\"running\":1"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_requests_renew_their_leases() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(5000));
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 1000}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 1}\n",
    );
    let c = client();
    let long = spawn_post(&c, gw.url("/reports/generate"), "a");
    up.wait_current("/reports/generate", 1).await;
    let arrived = *up.arrivals("/reports/generate").last().expect("arrived");
    // Well past lease_ttl (2 s), the long request still holds its slot (for 2 s more).
    tokio::time::sleep_until((arrived + Duration::from_millis(3000)).into()).await;
    let r = post(&c, gw.url("/reports/generate?delay_ms=1"), "b").await;
    assert_eq!(r.status(), 503, "the lease was renewed");
    assert_eq!(long.await.unwrap(), 200);
    // The slot goes back in the gateway's logging phase, after the answer was sent.
    wait_idle(&gw, "/reports/generate").await;
    let r = post(&c, gw.url("/reports/generate?delay_ms=1"), "b").await;
    assert_eq!(r.status(), 200, "released at the end");
    assert_eq!(up.max_concurrent("/reports/generate"), 1);
}

/// Kills Redis under load; checks the policy, the bounded latency, the degraded gauge, and
/// the return of the shared budget after a restart. Returns the recovery time.
async fn outage(on_error: &str) -> Duration {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        on_error,
        2,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
    );
    let c = client();
    // Every call Redis answered is counted `ok` and timed (DESIGN §5): the two admissions at
    // least (background calls may add to both alike).
    const OK: &str = "tollgate_store_calls_total{result=\"ok\"}";
    const TIMED: &str = "tollgate_store_duration_seconds_count";
    let (ok, timed) = (metric(&gw, OK).await, metric(&gw, TIMED).await);
    for _ in 0..2 {
        assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    }
    let more_ok = metric(&gw, OK).await - ok;
    assert!(more_ok >= 2.0, "{more_ok} more ok");
    assert!(metric(&gw, TIMED).await - timed >= more_ok);
    const FAILED: &str = "tollgate_store_calls_total{result=\"error\"}";
    let failed = metric(&gw, FAILED).await;
    redis.kill();

    let mut statuses = vec![];
    for _ in 0..12 {
        let t = Instant::now();
        let r = get(&c, gw.url("/items"), "k").await;
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
        statuses.push(r.status().as_u16());
        if r.status() == 503 {
            assert_eq!(header(&r, "Retry-After").as_deref(), Some("1"));
            // No budget can be read, but the policy is known and nothing was charged.
            assert_eq!(
                header(&r, "RateLimit-Policy").as_deref(),
                Some("\"default\";q=10;w=3600")
            );
            assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("0"));
            let v: serde_json::Value = r.json().await.unwrap();
            assert!(v["type"].as_str().unwrap().ends_with("store-unavailable"));
        }
    }
    match on_error {
        // Each of 2 instances may spend half of the 10 units on its own.
        "local" => assert_eq!(statuses, [vec![200; 5], vec![429; 7]].concat()),
        "allow" => assert_eq!(statuses, vec![200; 12]),
        "deny" => assert_eq!(statuses, vec![503; 12]),
        _ => unreachable!(),
    }
    assert_metric(&gw, "tollgate_store_degraded", 1.0).await;
    assert!(metric(&gw, "tollgate_store_calls_total{result=\"breaker_open\"}").await > 0.0);
    // A refused connection is an `error` (a hanging Redis's are `timeout`s: faults.rs).
    assert!(metric(&gw, FAILED).await > failed);
    // Each refusal counted by its reason: the fallback's share spent (budget), or the
    // store's absence under `deny`.
    let refused = |reason: &str| {
        format!("tollgate_rejections_total{{reason=\"{reason}\",route=\"default\"}}")
    };
    let budget = if on_error == "local" { 7.0 } else { 0.0 };
    assert_metric(&gw, &refused("budget"), budget).await;
    if on_error == "deny" {
        // (A series only where `deny` can refuse.)
        assert_metric(&gw, &refused("store_unavailable"), 12.0).await;
    }
    let ready = reqwest::get(gw.admin("/readyz")).await.unwrap().status();
    assert_eq!(ready == 503, on_error == "deny", "readyz {ready}");

    let _redis = Redis::start_on(port);
    let restarted = Instant::now();
    // A key of its own per attempt: what the fallback admits for a key is written back to
    // Redis when it returns (DESIGN §4), so only a key's first request reads a full budget.
    let mut attempt = 0;
    let fresh = loop {
        attempt += 1;
        let fresh = format!("fresh-key-{attempt}");
        let on_fallback = "tollgate_fallback_decisions_total{decision=\"admitted\"}";
        let before = metric(&gw, on_fallback).await;
        let r = get(&c, gw.url("/items"), &fresh).await;
        // Back on the shared (restarted, empty) store: the budget is in Redis, the full 10
        // units (not a local share).
        if r.status() == 200
            && header(&r, "X-RateLimit-Remaining").as_deref() == Some("9")
            && metric(&gw, on_fallback).await == before
        {
            break fresh;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(5),
            "shared budget not back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let recovery = restarted.elapsed();
    assert_metric(&gw, "tollgate_store_degraded", 0.0).await;
    assert_eq!(
        _redis.cli(&["EXISTS", &redis_budget_key(&fresh)]),
        "1",
        "the budget lives in Redis again"
    );
    // What the fallback admitted for "k" during the outage was charged there too.
    let written_back = || _redis.cli(&["EXISTS", &redis_budget_key("k")]) == "1";
    while on_error != "deny" && !written_back() {
        assert!(
            restarted.elapsed() < Duration::from_secs(8),
            "k not written back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(written_back(), on_error != "deny");
    recovery
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_on_error_local() {
    let d = outage("local").await;
    eprintln!("recovery after Redis restart (local): {d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_on_error_allow() {
    outage("allow").await;
}

/// A store call that fails is logged at WARN with its cause (DESIGN §5), also when it is one
/// failure that opens no breaker (here: Redis stopped for the one call, which times out); and
/// a Redis failing every call makes one such line per 10 s, with the count, not one per call.
/// (Before, only the breaker's opening was logged: a failure counted in
/// `tollgate_store_calls_total` had no line at the default level.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_store_call_is_logged_with_its_cause() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        "allow",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
    );
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    redis.pause();
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    redis.resume();
    let line = eventually(Duration::from_secs(5), async || {
        let log = gw.log();
        log.lines()
            .find(|l| l.contains("store calls failed"))
            .map(str::to_string)
            .ok_or(log)
    })
    .await;
    assert!(line.contains("\"level\":\"WARN\""), "{line}");
    assert!(line.contains("store call timed out"), "{line}");
    // Many more failures (Redis stopped for the next ten requests): one more line at most
    // per 10 s since the first, not one per failed call.
    let first = Instant::now();
    redis.pause();
    for i in 0..10 {
        let r = c
            .get(gw.url("/items"))
            .header("X-API-Key", "k")
            .header("X-Request-Id", format!("failing-{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    redis.resume();
    // Everything before the last request's access-log line has been written by then.
    gw.wait_log("failing-9").await;
    let lines = gw
        .log()
        .lines()
        .filter(|l| l.contains("store calls failed"))
        .count();
    let most = 1 + (first.elapsed().as_secs() / 10) as usize;
    assert!((1..=most).contains(&lines), "{lines} lines:\n{}", gw.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_on_error_deny() {
    outage("deny").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn starts_while_redis_is_down() {
    let port = free_port();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"redis://127.0.0.1:{port}/0\"\n  timeout: 50ms\n  on_error: local\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 10}}\n"
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 200);
    let _redis = Redis::start_on(port);
    let start = Instant::now();
    // The key's budget (beside it, the records of its admissions' ids).
    while _redis.cli(&["KEYS", "t{*}b"]).lines().count() != 1 {
        assert!(start.elapsed() < Duration::from_secs(5));
        get(&c, gw.url("/items"), "k").await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_flush_mid_run_keeps_one_budget() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
    );
    let c = client();
    let mut remaining = vec![];
    for i in 0..12 {
        if i == 4 || i == 7 {
            assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]), "OK");
        }
        let r = get(&c, gw.url("/items"), "k").await;
        remaining.push((
            r.status().as_u16(),
            header(&r, "X-RateLimit-Remaining").unwrap(),
        ));
    }
    let want: Vec<(u16, String)> = (0..12)
        .map(|i| {
            if i < 10 {
                (200, (9 - i).to_string())
            } else {
                (429, "0".into())
            }
        })
        .collect();
    assert_eq!(remaining, want);
    assert_eq!(up.count("/items"), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_with_skewed_clocks_agree() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = redis_body(
        &redis,
        "deny",
        2,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
    );
    let mk = |offset: &str| {
        Gateway::start_opts(GatewayOpts {
            upstream_url: up.url(),
            body: &body,
            env: vec![("TOLLGATE_CLOCK_OFFSET_MS", offset.to_string())],
            ..GatewayOpts::default()
        })
    };
    let ahead = mk("3600000");
    let behind = mk("-3600000");
    let c = client();
    let mut seen = vec![];
    for i in 0..12 {
        let gw = if i % 2 == 0 { &ahead } else { &behind };
        let r = get(&c, gw.url("/items"), "k").await;
        seen.push(header(&r, "X-RateLimit-Remaining").unwrap());
    }
    let want: Vec<String> = (0..12).map(|i: i32| (9 - i).max(0).to_string()).collect();
    assert_eq!(seen, want);
    assert_eq!(up.count("/items"), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_round_trip_per_admitted_request_and_none_when_over_budget() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // The exact path's round trips (budget slices, when on, make fewer: tests/slices.rs).
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "  slices: false\nrate_limits:\n  default: {cost: 1, window: 1h, max_cost: 50}\n",
    );
    let c = client();
    // Warm up: loads the script (one NOSCRIPT round) and the connection.
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    let stats = |r: &Redis| -> std::collections::BTreeMap<String, u64> {
        let info = r.cli(&["INFO", "commandstats"]);
        info.lines()
            // INFO (the test's own, and the gateway's `run_id` read on a new connection),
            // CONFIG (its `maxmemory-policy` check, at start and every minute) and the look at
            // the fleet's routes with waiters (ZREMRANGEBYSCORE and ZRANGE every 5 s) are not
            // requests' calls.
            .filter(|l| {
                l.starts_with("cmdstat_")
                    && !l.starts_with("cmdstat_info:")
                    && !l.starts_with("cmdstat_config|")
                    && !l.starts_with("cmdstat_zrange:")
                    && !l.starts_with("cmdstat_zremrangebyscore:")
            })
            .filter_map(|l| {
                let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(":calls=")?;
                Some((
                    name.to_string(),
                    rest.split(',').next()?.parse::<u64>().ok()?,
                ))
            })
            .collect()
    };
    let calls = |r: &Redis| -> u64 { stats(r).values().sum() };
    let before = stats(&redis);
    for _ in 0..40 {
        assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    }
    let after = stats(&redis);
    let delta: std::collections::BTreeMap<String, u64> = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect();
    // Redis counts the commands a script runs too: TIME, GET and SET of the budget, the
    // admission id's record written by the SET that looks for it (SET NX GET), inside each
    // EVALSHA, and HGETALL of the key's budget slices held (none here). The only command the
    // gateway sent was EVALSHA, once per request (`store.slices` is off by default; with it,
    // tests/slices.rs).
    let want: std::collections::BTreeMap<String, u64> = [
        ("evalsha", 40),
        ("get", 40),
        ("hgetall", 40),
        ("set", 80),
        ("time", 40),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(
        delta, want,
        "exactly one round trip (EVALSHA) per admitted request"
    );
    // Exhaust the budget (9 left): the 10th refusal is decided by Redis...
    for _ in 0..9 {
        get(&c, gw.url("/items"), "k").await;
    }
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 429);
    let after_first_refusal = calls(&redis);
    // ...and every later one locally, until Redis said a unit would be back (72 s).
    for _ in 0..50 {
        let r = get(&c, gw.url("/items"), "k").await;
        assert_eq!(r.status(), 429);
        let ra: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
        assert!((70..=72).contains(&ra), "{ra}");
    }
    assert_eq!(
        calls(&redis),
        after_first_refusal,
        "no round trip for an over-budget key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_redis_stores_decide_alike() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use tollgate::budget::Limit;
    use tollgate::config::{Backend, OnError, StoreSettings};
    use tollgate::store::memory::Clock;
    use tollgate::store::{Admission, AdmitRequest, Bucket, Extra, MemoryStore, RedisStore};

    // One clock for both stores: each request goes to Redis first, and the memory store then
    // decides it at the very instant Redis's `TIME` gave that call. Comparing two runs made
    // one after the other compared two sets of instants, and a rounding boundary fell between
    // them now and then (`retry_s=858` against `857`).
    let redis = Redis::start();
    let settings = StoreSettings {
        backend: Backend::Redis,
        url: redis.url(),
        timeout: Duration::from_millis(200),
        on_error: OnError::Deny,
        fleet_size: 1,
        lease_ttl: Duration::from_secs(15),
        slices: false,
    };
    let now: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let memory = MemoryStore::new(Clock::manual(now));
    let shared = RedisStore::new(&settings, Clock::new(0));
    let limits = [
        Limit::new(120, Duration::from_secs(3600), Duration::ZERO).unwrap(),
        Limit::new(7, Duration::from_secs(3600), Duration::from_secs(1200)).unwrap(),
        Limit::new(100_000_000, Duration::from_secs(3600 * 24), Duration::ZERO).unwrap(),
        // Plans of several budgets: this day one and a minute one (listed second) that is
        // looser (the day budget refuses first) or tighter (the minute budget does).
        Limit::new(
            25,
            Duration::from_secs(3600 * 24),
            Duration::from_secs(1200),
        )
        .unwrap(),
    ];
    let minute = |max_cost, delay_s| Extra {
        bucket: Bucket::Key("minute".into()),
        limit: Limit::new(
            max_cost,
            Duration::from_secs(60),
            Duration::from_secs(delay_s),
        )
        .unwrap(),
    };
    let extras = [vec![minute(20, 30)], vec![minute(5, 0)]];
    // A fixed pseudo-random sequence of (key, limit, cost).
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut seq = vec![];
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = (x % 4) as u8;
        let li = ((x >> 8) % 5) as usize;
        let cost = match li {
            0 => 1 + (x >> 16) % 30,
            1 => 1 + (x >> 16) % 3,
            2 => 1 + (x >> 16) % 40_000_000,
            _ => 1 + (x >> 16) % 8,
        };
        seq.push((key, li, cost));
    }
    // The decision as a line: verdict, whole units left, the delay or retry in whole seconds
    // rounded up (what the headers show), the decisive budget and every budget's units left.
    let line = |a: &Admission| match a {
        Admission::Admitted {
            standing: o,
            delay_us,
            ..
        } => format!(
            "admit r={} delay_s={} by={} each={:?}",
            o.remaining,
            delay_us.div_ceil(1_000_000),
            o.each.decisive,
            o.each
                .as_slice()
                .iter()
                .map(|f| f.remaining)
                .collect::<Vec<_>>()
        ),
        Admission::OverBudget {
            standing: o,
            retry_after_us,
        } => format!(
            "reject r={} retry_s={} by={} each={:?}",
            o.remaining,
            retry_after_us.div_ceil(1_000_000),
            o.each.decisive,
            o.each
                .as_slice()
                .iter()
                .map(|f| f.remaining)
                .collect::<Vec<_>>()
        ),
        other => format!("{other:?}"),
    };
    let retry_s = |a: &Admission| match a {
        Admission::OverBudget { retry_after_us, .. } => Some(retry_after_us.div_ceil(1_000_000)),
        _ => None,
    };
    let mut memory_lines = vec![];
    let mut cached = 0;
    // Redis's TIME at its last answer, and this process's instant when that answer was in.
    let mut last: Option<(u64, std::time::Instant)> = None;
    for (i, &(key, li, cost)) in seq.iter().enumerate() {
        let req = AdmitRequest {
            key: [key + li as u8 * 10; 32],
            limit: limits[li.min(3)],
            also: if li >= 3 {
                extras[li - 3].clone()
            } else {
                vec![]
            },
            cost,
            key_cap: None,
            route: Arc::from("r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        let before = shared.shared().last_decided_us();
        let r = shared.admit(&req).await;
        let decided_at = shared.shared().last_decided_us();
        if decided_at != before {
            // Redis decided: the memory store decides at the same instant, and must agree
            // exactly.
            now.store(decided_at, Ordering::Relaxed);
            last = Some((decided_at, std::time::Instant::now()));
            let m = memory.admit(&req).await;
            assert_eq!(line(&m), line(&r), "decision {i} ({:?}) differs", seq[i]);
            memory_lines.push(line(&m));
        } else {
            // The deny cache refused a key Redis had just refused, on this process's clock
            // (counted from Redis's last answer): the same verdict, and a retry within a
            // second of the model's at the instant this process reckons Redis is at.
            cached += 1;
            let (t, seen) = last.expect("a cached refusal follows one from Redis");
            now.store(t + seen.elapsed().as_micros() as u64, Ordering::Relaxed);
            let m = memory.admit(&req).await;
            let (ms, rs) = (retry_s(&m), retry_s(&r));
            assert!(
                ms.zip(rs).is_some_and(|(ms, rs)| ms.abs_diff(rs) <= 1),
                "decision {i} ({:?}): memory {} against the deny cache's {}",
                seq[i],
                line(&m),
                line(&r)
            );
            memory_lines.push(line(&m));
        }
    }
    assert!(
        cached < seq.len() / 2,
        "{cached} of the decisions were cached"
    );
    assert!(memory_lines.iter().any(|d| d.starts_with("reject")));
    assert!(memory_lines
        .iter()
        .any(|d| d.contains("delay_s=") && !d.contains("delay_s=0")));
    // The plan of two budgets was refused by each of them at some point.
    for by in ["by=0 each=[", "by=1 each=["] {
        assert!(
            memory_lines
                .iter()
                .any(|d| d.starts_with("reject") && d.contains(by) && !d.contains("each=[]")),
            "{by}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_key_cap_is_fleet_wide() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = redis_body(
        &redis,
        "deny",
        2,
        &format!(
            "rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\nplans:\n  gold: {{max_cost: 100, window: 1h, max_in_flight_per_key: 1}}\nkeys:\n  - {{id: g, sha256: \"{}\", plan: gold}}\n",
            sha256_hex("gold")
        ),
    );
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    let c = client();
    let slow = spawn_get(&c, a.url("/items?delay_ms=1000"), "gold");
    up.wait_current("/items", 1).await;
    let r = get(&c, b.url("/items"), "gold").await;
    assert_eq!(
        r.status(),
        429,
        "the key's one slot is taken on the other instance"
    );
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["type"].as_str().unwrap().ends_with("concurrency-limit"));
    assert_eq!(slow.await.unwrap(), 200);
    // A releases the slot as its request ends (logging phase, just after the response).
    let start = Instant::now();
    let r = loop {
        let r = get(&c, b.url("/items"), "gold").await;
        if r.status() != 429 || start.elapsed() > Duration::from_secs(2) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("98"));
    // Either instance's admin listener reads the shared budget from Redis.
    for gw in [&a, &b] {
        let v = admin_json(gw, "/admin/keys/g").await;
        assert_eq!(
            (v["plan"].as_str(), v["remaining"].as_u64()),
            (Some("gold"), Some(98))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn password_url_from_env_and_rediss() {
    let up = Upstream::start(Duration::ZERO);
    let limits = "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n";

    // A password-protected Redis, its URL given by TOLLGATE_REDIS_URL over a dead store.url.
    let port = free_port();
    let redis = Redis::start_with(port, &["--requirepass", "s3cret"]);
    let body = format!(
        "store:\n  backend: redis\n  url: \"redis://127.0.0.1:1/0\"\n  timeout: 200ms\n  on_error: deny\n{limits}"
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        env: vec![(
            "TOLLGATE_REDIS_URL",
            format!("redis://:s3cret@127.0.0.1:{port}/0"),
        )],
        ..GatewayOpts::default()
    });
    let c = client();
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        redis
            .cli(&["-a", "s3cret", "--no-auth-warning", "KEYS", "t{*}b"])
            .lines()
            .count(),
        1
    );
    let cfg = admin_text(&gw, "/admin/config").await;
    assert!(!cfg.contains("s3cret"), "{cfg}");
    assert!(!gw.log().contains("s3cret"));

    // TLS: rediss://, the server's CA trusted through SSL_CERT_FILE.
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(dir.path());
    let tls_port = free_port();
    let _tls = Redis::start_with(
        tls_port,
        &[
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            pki.cert_file.to_str().unwrap(),
            "--tls-key-file",
            pki.key_file.to_str().unwrap(),
            "--tls-ca-cert-file",
            pki.ca_file.to_str().unwrap(),
            "--tls-auth-clients",
            "no",
        ],
    );
    let body = format!(
        "store:\n  backend: redis\n  url: \"rediss://localhost:{tls_port}/0\"\n  timeout: 200ms\n  on_error: deny\n{limits}"
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        env: vec![("SSL_CERT_FILE", pki.ca_file.display().to_string())],
        ..GatewayOpts::default()
    });
    for want in ["9", "8"] {
        let r = get(&c, gw.url("/items"), "k").await;
        assert_eq!(r.status(), 200, "{}", gw.log());
        assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some(want));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_share_connections() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1s, max_cost: 1000000}\n",
    );
    let c = client();
    for _round in 0..5 {
        let rs = all_at_once(64, |i| {
            c.get(gw.url("/items")).header("X-API-Key", format!("k{i}"))
        })
        .await;
        let statuses = sorted_statuses(&rs);
        assert_eq!(statuses, vec![200; 64]);
    }
    // One multiplexed connection per proxy worker thread (2 here), not one per request, one
    // for the `maxmemory-policy` check, one for the store probe, and the give-back listener's
    // two (threads of their own): its subscription and the connection its heartbeat goes on.
    let clients = redis.cli(&["CLIENT", "LIST"]);
    let gateway_conns: Vec<&str> = clients
        .lines()
        .filter(|l| !l.contains("cmd=client"))
        .collect();
    assert!(
        (1..=6).contains(&gateway_conns.len()),
        "{} connections:\n{clients}",
        gateway_conns.len()
    );
    let subscribed = gateway_conns
        .iter()
        .filter(|l| !l.contains(" sub=0 "))
        .count();
    assert_eq!(subscribed, 1, "{clients}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timed_out_admission_is_not_charged() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n  endpoints:\n    /reports/generate: {cost: 3, max_in_flight: 1}\n",
    );
    let c = client();
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("9"));
    // Redis stops answering for 700 ms: the request gives up after store.timeout (200 ms) and,
    // under `deny`, answers 503. Redis then runs the script after all (it was already sent).
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "700", "ALL"]), "OK");
    let r = post(&c, gw.url("/reports/generate"), "k").await;
    assert_eq!(r.status(), 503);
    // Once Redis answers (after the pause) the late admission is undone, by its id; the
    // wait covers the pause and the undo's round trip on a loaded machine.
    gw.wait_log("a timed-out admission reached Redis after all")
        .await;
    gw.wait_log("undone by its id").await;
    // Its 3 units are back and its slot is free.
    let r = post(&c, gw.url("/reports/generate"), "k").await;
    assert_eq!(r.status(), 200, "the slot was released");
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("6"));
    assert_eq!(up.count("/reports/generate"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_keys_expire_when_the_bucket_is_full_again() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 1}\n",
    );
    let c = client();
    get(&c, gw.url("/items"), "slow-key").await;
    let keys = redis.cli(&["KEYS", "t{*}b"]);
    assert_eq!(keys.lines().count(), 1, "{keys}");
    // One unit of 10 per hour is back in 6 minutes: the key lives exactly that long.
    let pttl: i64 = redis.cli(&["PTTL", keys.trim()]).parse().unwrap();
    assert!((355_000..=360_000).contains(&pttl), "PTTL {pttl}");
    // A capped route's lease set lives as long as its last lease (lease_ttl 2 s, + 1 s).
    let held = spawn_post(&c, gw.url("/reports/generate?delay_ms=800"), "slow-key");
    up.wait_current("/reports/generate", 1).await;
    let sets = redis.cli(&["KEYS", "t:r{*}f"]);
    assert_eq!(sets.lines().count(), 1, "{sets}");
    let pttl: i64 = redis.cli(&["PTTL", sets.trim()]).parse().unwrap();
    assert!((2_000..=3_000).contains(&pttl), "lease set PTTL {pttl}");
    assert_eq!(held.await.unwrap(), 200);
    // Released: the empty set is gone.
    let start = Instant::now();
    while !redis.cli(&["KEYS", "t:r{*}f"]).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "lease not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A fast budget: 10 per second. One unit is back in 100 ms, and so is the key gone.
    let gw = gateway_on(
        &up,
        &redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1s, max_cost: 10}\n",
    );
    redis.cli(&["FLUSHALL"]);
    get(&c, gw.url("/items"), "fast-key").await;
    // The budget, and the record of the admission's id, which lives no longer than it.
    let keys = redis.cli(&["KEYS", "*"]);
    let mut keys: Vec<&str> = keys.lines().collect();
    keys.sort();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys[0].contains("}a") && keys[1].ends_with("}b"),
        "{keys:?}"
    );
    // An idle, refilled budget leaves nothing behind: both keys expire within 100 ms, and
    // Redis removes expired keys in its active cycle (10 a second).
    redis
        .wait_cli(&["DBSIZE"], "0", Duration::from_secs(3))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_separates_the_store_round_trip_from_queueing() {
    let up = Upstream::start(Duration::ZERO);
    let redis = Redis::start();
    let gw = gateway_on(&up, &redis, "local", 1, INCIDENT);
    let c = client();
    for _ in 0..5 {
        assert_eq!(get(&c, gw.url("/items/1"), "k").await.status(), 200);
    }
    let events = gw.wait_access(5, |_| true).await;
    for e in &events {
        // An uncapped route never queues: the Redis round trip is store time.
        let (queue, store) = (
            e["queue_ms"].as_f64().unwrap(),
            e["store_ms"].as_f64().unwrap(),
        );
        assert!(store > 0.01 && queue < store / 10.0, "{e}");
    }
}

/// A gateway on `redis` a network away (a proxy delivering everything `way` late each way),
/// with the incident's rate limits and `/reports/generate` capped by `caps` (endpoint lines).
fn behind_a_slow_redis(
    redis: &Redis,
    up: &Upstream,
    way: Duration,
    caps: &str,
) -> (Gateway, Proxy) {
    let proxy = Proxy::start_delayed(redis.port, way);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 5s\n  on_error: deny\n{}",
        proxy.url(),
        incident_with_report_caps(caps)
    );
    (Gateway::start(up, &body), proxy)
}

/// A capped route's admission is two calls to a Redis a network away (its key's budget, then
/// the route's queue), each a round trip of 60 ms at least: that is store time. With the slot
/// free it waits for nothing, so its queue time is nil (the access log, and the queue-wait
/// histogram). Both went to queue time, and store time was near 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_routes_store_round_trips_are_not_queue_time() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let caps = "      max_in_flight: 2\n      queue_timeout: 5s\n";
    let (gw, _proxy) = behind_a_slow_redis(&redis, &up, Duration::from_millis(30), caps);
    let c = client();
    for _ in 0..3 {
        assert_eq!(
            post(&c, gw.url("/reports/generate"), "k").await.status(),
            200
        );
    }
    let events = gw.wait_access(3, |_| true).await;
    for e in &events {
        let (queue, store) = (
            e["queue_ms"].as_f64().unwrap(),
            e["store_ms"].as_f64().unwrap(),
        );
        assert!(store >= 120.0 && queue < 5.0, "{e}");
    }
    let waited = metric(
        &gw,
        "tollgate_queue_wait_seconds_sum{route=\"/reports/generate\"}",
    )
    .await;
    assert!(waited < 0.015, "{waited}");
}

/// A request that waits its queue_timeout for a slot on a route with `max_queue`, Redis a
/// network away, is refused for its wait ("no slot freed within 1000 ms", its wait counted),
/// not as one its full queue refused at once: it was said to find its queue full whenever its
/// calls to Redis made its wait for a grant shorter than the queue_timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_waiter_is_not_told_its_queue_was_full() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let caps = "      max_in_flight: 1\n      queue_timeout: 1s\n      max_queue: 5\n";
    let (gw, _proxy) = behind_a_slow_redis(&redis, &up, Duration::from_millis(20), caps);
    let c = client();
    let holder = spawn_post(&c, gw.url("/reports/generate?delay_ms=3000"), "a");
    up.wait_current("/reports/generate", 1).await;
    let r = post(&c, gw.url("/reports/generate"), "b").await;
    assert_eq!(r.status(), 503);
    let detail = r.json::<serde_json::Value>().await.unwrap()["detail"].clone();
    assert_eq!(
        detail,
        "/reports/generate allows 1 request in flight; no slot freed within 1000 ms"
    );
    let series = "tollgate_queue_wait_seconds_count{route=\"/reports/generate\"}";
    wait_metric(&gw, series, 2.0, Duration::from_secs(5)).await;
    assert_eq!(holder.await.unwrap(), 200);
}

/// Group commit across a fleet (`store::redis::batch`): while Redis is paused, each worker
/// thread of three gateways has two `admit` calls in flight and gathers the rest of 60
/// requests (cost 2, one key, 25 units left) behind them; they then go as batches, which
/// straddle the budget's last units. Exactly what sequential calls would admit is admitted: 12
/// (24 units), the 13th refused although 1 unit is left, which a cost-1 request then takes.
/// And Redis ran far fewer calls than requests: per worker thread two alone, then a batch
/// when the first lands (18 for the six threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_straddling_a_budgets_last_units_admit_exactly_what_fits() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 1500ms\n  on_error: deny\n  fleet_size: 3\n  lease_ttl: 2s\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 26}}\n  endpoints:\n    /heavy: {{cost: 2}}\n",
        redis.url()
    );
    let gws = fleet(&up, 3, &body);
    let c = client();
    // Every gateway connected (and the scripts loaded), one unit spent.
    for gw in &gws {
        assert_eq!(get(&c, gw.url("/items"), "warm").await.status(), 200);
    }
    let r = get(&c, gws[0].url("/items"), "k").await;
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("25"));
    // EVALSHA calls that ran a script: Redis counts one refused with NOSCRIPT (a batch sent
    // before it had the batch script) as a call, and as a failed one.
    let evalsha = |r: &Redis| -> u64 {
        let info = r.cli(&["INFO", "commandstats"]);
        let Some(stats) = info
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        else {
            return 0;
        };
        let field = |name: &str| -> u64 {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        field("calls") - field("failed_calls")
    };
    let before = evalsha(&redis);
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1000", "ALL"]), "OK");
    let sent: Vec<_> = (0..60)
        .map(|i| spawn_get(&c, gws[i % 3].url("/heavy"), "k"))
        .collect();
    let mut statuses = std::collections::BTreeMap::<u16, u32>::new();
    for s in sent {
        *statuses.entry(s.await.unwrap()).or_default() += 1;
    }
    assert_eq!(
        statuses,
        [(200, 12), (429, 48)].into_iter().collect(),
        "exactly the 12 that fit"
    );
    assert_eq!(up.count("/heavy"), 12);
    let calls = evalsha(&redis) - before;
    assert!(calls < 30, "{calls} EVALSHA for 60 admissions: no batches");
    // The unit the 13th did not fit in is left, and only it.
    let r = get(&c, gws[1].url("/items"), "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("0"));
    assert_eq!(get(&c, gws[2].url("/items"), "k").await.status(), 429);
}

/// Group commit where Redis is a network away (a proxy delivering everything 500 ms late
/// each way: a round trip of 1 s at least). Request A's admission is in flight on the
/// gateway's only worker thread when request B arrives: B's call goes at once beside it
/// (`store::redis::batch`: two calls in flight per thread) rather than waiting the rest of
/// A's round trip and then its own (about 2 s). Both are admitted and charged once. (The
/// bound between the two, 1.5 s, leaves half a second on either side for a loaded machine.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_does_not_wait_for_the_call_in_flight_before_it() {
    const WAY: Duration = Duration::from_millis(500);
    let redis = Redis::start();
    let proxy = Proxy::start_delayed(redis.port, WAY);
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 5s\n  on_error: deny\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n",
        proxy.url()
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        threads: 1,
        ..GatewayOpts::default()
    });
    let c = client();
    // Connected, and the script loaded, at a round trip each.
    assert_eq!(get(&c, gw.url("/items"), "warm").await.status(), 200);
    let before = proxy.read_from_clients();
    let a = spawn_get(&c, gw.url("/items"), "a");
    // A's call has left the gateway (it lands 1 s later, at the earliest).
    eventually(Duration::from_secs(5), async || {
        (proxy.read_from_clients() > before)
            .then_some(())
            .ok_or_else(|| "A's call never reached the proxy".to_string())
    })
    .await;
    let sent = Instant::now();
    let b = get(&c, gw.url("/items"), "b").await;
    let took = sent.elapsed();
    assert_eq!(b.status(), 200);
    assert_eq!(a.await.unwrap(), 200);
    assert!(
        took >= 2 * WAY,
        "B took {took:?}: its admission went through Redis"
    );
    // Waiting for A's call to land first would take B nearly 4 × WAY (2 s).
    assert!(
        took < 3 * WAY,
        "B took {took:?}: it waited for A's call to land before its own left"
    );
    assert_eq!(header(&b, "X-RateLimit-Remaining").as_deref(), Some("99"));
}
