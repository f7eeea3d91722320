//! Redis faults under load, and what the fleet still promises (DESIGN §4): at most N in flight,
//! at most the budget (plus one extra burst of the local shares), and no slot left blocked by
//! an outage or an exit.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn store_body(redis: &Redis, on_error: &str, fleet_size: u32, rate_limits: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 100ms\n  on_error: {on_error}\n  fleet_size: {fleet_size}\n  lease_ttl: 15s\n{rate_limits}",
        redis.url()
    )
}

/// One instance on `redis` under `on_error: deny`; 10 units an hour a key.
fn ten_an_hour_or_deny(redis: &Redis) -> String {
    store_body(
        redis,
        "deny",
        1,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
    )
}

/// `/reports/generate` costs 1 and runs at most `cap` at once, fleet-wide.
fn capped(cap: u32) -> String {
    incident_with_report_caps(&format!("      max_in_flight: {cap}\n"))
}

/// Sends `n` report requests to `gw` at once, each with a key of its own; the statuses, sorted.
async fn reports(gw: &Gateway, n: usize) -> Vec<u16> {
    let c = client();
    let rs = all_at_once(n, |i| {
        c.post(gw.url("/reports/generate"))
            .header("X-API-Key", format!("r{i}"))
    })
    .await;
    sorted_statuses(&rs)
}

/// Starts `n` report requests on `gw` in the background (their answers don't matter).
fn start_reports(gw: &Gateway, n: usize) {
    for i in 0..n {
        let url = gw.url("/reports/generate");
        tokio::spawn(async move {
            let _ = client()
                .post(url)
                .header("X-API-Key", format!("bg{i}"))
                .send()
                .await;
        });
    }
}

/// (a) Requests that finish while Redis is stopped cannot release their slots; once it
/// answers again, they are released without any further traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slots_of_requests_finished_during_a_stall_are_free_soon_after() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(2500));
    let body = store_body(&redis, "deny", 2, &capped(4));
    let a = Gateway::start(&up, &body);
    let b = Gateway::start(&up, &body);
    let c = client();

    let running = tokio::spawn({
        let url = a.url("/reports/generate");
        async move {
            let c = client();
            let rs = all_at_once(4, |i| c.post(&url).header("X-API-Key", format!("a{i}"))).await;
            sorted_statuses(&rs)
        }
    });
    up.wait_current("/reports/generate", 4).await;
    const TIMED_OUT: &str = "tollgate_store_calls_total{result=\"timeout\"}";
    let timed_out = metric(&a, TIMED_OUT).await;
    redis.pause();
    // Calls time out: the breaker opens before the four finish, so their releases can't go.
    for _ in 0..4 {
        assert_eq!(get(&c, a.url("/items"), "other").await.status(), 503);
    }
    // Counted as timeouts (DESIGN §5), the refusals by their reason (`deny`).
    assert!(metric(&a, TIMED_OUT).await > timed_out);
    assert_metric(
        &a,
        "tollgate_rejections_total{reason=\"store_unavailable\",route=\"default\"}",
        4.0,
    )
    .await;
    assert_eq!(running.await.unwrap(), vec![200; 4]);
    redis.resume();
    // Released in Redis without any further traffic, soon (a retry every 200 ms behind the
    // breaker's probe).
    redis
        .wait_route_slots("/reports/generate", 0, Duration::from_secs(5))
        .await;
    assert_eq!(reports(&b, 4).await, vec![200; 4], "the whole cap on B");
    assert_eq!(up.max_concurrent("/reports/generate"), 4);
    assert_eq!(up.count("/reports/generate"), 8);
}

/// (b) The local share counts what this instance already runs through Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_route_stays_full_when_redis_dies() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(2500));
    let gw = Gateway::start(&up, &store_body(&redis, "local", 2, &capped(4)));

    start_reports(&gw, 4);
    up.wait_current("/reports/generate", 4).await;
    redis.kill();
    // 4 run here already, more than this instance's share (4/2): nothing more goes.
    assert_eq!(reports(&gw, 4).await, vec![503; 4]);
    assert_eq!(up.max_concurrent("/reports/generate"), 4);
    assert_eq!(up.count("/reports/generate"), 4);
    // Once they are done, the share is there: 2 of 3. Done as the gateway counts it: the
    // upstream's count drops before the gateway has read the answer and freed the slot (its
    // release tries the dead Redis first), so waiting on the upstream raced that release.
    wait_idle(&gw, "/reports/generate").await;
    assert_eq!(up.count("/reports/generate"), 4);
    assert_eq!(reports(&gw, 3).await, vec![200, 200, 503]);
    assert_eq!(up.max_concurrent("/reports/generate"), 4);
    assert_metric(
        &gw,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
        2.0,
    )
    .await;
    assert_metric(
        &gw,
        "tollgate_fallback_decisions_total{decision=\"rejected\"}",
        5.0,
    )
    .await;
}

/// A reload during an outage holds for the requests already waiting in the local queue
/// (README, Signals): a larger cap's new share is handed to them at once, a smaller one holds
/// for them too. They kept the share of the config they arrived under.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_during_an_outage_holds_for_the_local_waiters() {
    // The first two run long when the cap grows (the waiters must start beside them, however
    // long the reload takes), short when it shrinks (the waiters then run one after another).
    for (to, share, slow) in [(8, 4, 30), (2, 1, 3)] {
        let mut redis = Redis::start();
        let slow = Duration::from_secs(slow);
        let up = Upstream::start(slow);
        let caps = "      max_in_flight: 4\n      queue_timeout: 30s\n";
        let gw = Gateway::start(
            &up,
            &store_body(&redis, "local", 2, &incident_with_report_caps(caps)),
        );
        redis.kill();
        // A share of 2: two run, two wait here.
        start_reports(&gw, 4);
        up.wait_current("/reports/generate", 2).await;
        wait_queued(&gw, "/reports/generate", 2.0).await;
        gw.edit_config("max_in_flight: 4", &format!("max_in_flight: {to}"));
        gw.reload(0.0).await;
        if share == 4 {
            // The waiters take the new slots beside the two still running.
            up.wait_current("/reports/generate", 4).await;
            assert_eq!(
                metric(&gw, "tollgate_queued{route=\"/reports/generate\"}").await,
                0.0
            );
            continue;
        }
        // A share of 1: once the first two are done, one at a time.
        eventually(Duration::from_secs(30), async || {
            match up.count("/reports/generate") {
                4 => Ok(()),
                n => Err(format!("{n} of 4 started")),
            }
        })
        .await;
        let at = up.arrivals("/reports/generate");
        assert!(
            at[3] - at[2] >= slow,
            "the last two ran together: {:?} apart",
            at[3] - at[2]
        );
        assert_eq!(up.max_concurrent("/reports/generate"), 2);
        wait_idle(&gw, "/reports/generate").await;
    }
}

/// (c) What the local shares admitted during an outage is charged to the shared budget when
/// it returns, even into a Redis that restarted empty: the key then waits out the debt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_local_shares_are_written_back_as_debt() {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = Upstream::start(Duration::ZERO);
    // 10 units per 60 s: one unit drains every 6 s (time enough for the two instances'
    // write-backs, up to ~1.25 s apart, and the check after them). Two instances: 5 units each
    // on their own.
    let body = store_body(
        &redis,
        "local",
        2,
        "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 10}\n",
    );
    let gws = [Gateway::start(&up, &body), Gateway::start(&up, &body)];
    let c = client();
    redis.kill();
    for gw in &gws {
        let mut statuses = vec![];
        for _ in 0..6 {
            statuses.push(get(&c, gw.url("/items"), "k").await.status().as_u16());
        }
        assert_eq!(statuses, [vec![200; 5], vec![429]].concat());
    }
    assert_metric(
        &gws[0],
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
        5.0,
    )
    .await;
    assert_metric(
        &gws[0],
        "tollgate_fallback_decisions_total{decision=\"rejected\"}",
        1.0,
    )
    .await;

    let redis = Redis::start_on(port);
    // Both instances write their 5 units back on their own: the budget key then lives for
    // ~60 s (it expires when the bucket is empty again), i.e. 10 units (one alone: 30 s).
    let key = redis_budget_key("k");
    let start = Instant::now();
    loop {
        let pttl: i64 = redis.cli(&["PTTL", &key]).parse().unwrap_or(-2);
        if pttl > 51_000 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the local charges never reached Redis (PTTL {pttl})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = get(&c, gws[0].url("/items"), "k").await;
    assert_eq!(r.status(), 429, "the key is in debt");
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((1..=6).contains(&retry), "Retry-After {retry}");
    assert_eq!(get(&c, gws[1].url("/items"), "k").await.status(), 429);
    tokio::time::sleep(Duration::from_millis(retry * 1000 + 300)).await;
    assert_eq!(get(&c, gws[1].url("/items"), "k").await.status(), 200);
    assert_eq!(get(&c, gws[0].url("/items"), "k").await.status(), 429);
    assert_eq!(up.count("/items"), 11);
}

/// (d) An instance that exits past its grace period releases the slots it holds first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exit_past_the_grace_period_frees_the_slots() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(4));
    let body = store_body(&redis, "deny", 2, &capped(3));
    let mut a = Gateway::start_with_grace(&up, &body, "1s");
    let b = Gateway::start(&up, &body);

    start_reports(&a, 3);
    up.wait_current("/reports/generate", 3).await;
    a.signal("TERM");
    assert_eq!(a.wait_exit(Duration::from_secs(5)), Some(0));
    // Right after the exit: the three slots are B's.
    assert_eq!(reports(&b, 3).await, vec![200; 3]);
    assert_eq!(up.count("/reports/generate"), 6);
}

/// (d') What an exit releases is released as a request's end releases it: the slot, and its
/// key's count on the route. Left behind, the count kept a key at its `max_in_flight_per_key`
/// share for as long as anyone used the route: every later request of that key waited out
/// its queue_timeout (503) while the route stood idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exit_past_the_grace_period_leaves_its_keys_their_share() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(4));
    let body = store_body(
        &redis,
        "deny",
        2,
        &capped(3).replace(
            "      max_in_flight: 3\n",
            "      max_in_flight: 3\n      max_in_flight_per_key: 1\n      queue_timeout: 5s\n",
        ),
    );
    let mut a = Gateway::start_with_grace(&up, &body, "1s");
    let b = Gateway::start(&up, &body);
    start_reports(&a, 1);
    up.wait_current("/reports/generate", 1).await;
    a.signal("TERM");
    assert_eq!(a.wait_exit(Duration::from_secs(5)), Some(0));
    let routes = admin_json(&b, "/admin/routes").await;
    let route = route_entry(&routes, "/reports/generate");
    assert_eq!(route["running"], 0, "{routes}");
    assert_eq!(route["keys"], serde_json::json!([]), "{routes}");
    // The same key gets its one slot, not a 503 at its queue_timeout.
    let r = post(&client(), b.url("/reports/generate"), "bg0").await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.count("/reports/generate"), 2);
}

/// The report route with one slot, a 30 s queue and an hour's budget (nothing refills while
/// a test runs).
fn one_slot_queued() -> String {
    capped(1)
        .replace("    window: 60s\n", "    window: 1h\n")
        .replace(
            "      max_in_flight: 1\n",
            "      max_in_flight: 1\n      queue_timeout: 30s\n",
        )
}

/// Three requests of key `waiting-key` queued on `gw` behind a report that outlasts the grace
/// period (1 s); then SIGTERM. Each queued one is answered 503 `route-busy`, `Retry-After: 1`,
/// with one access-log line (its wait shown as `queue_ms`); before, they were cut off by the
/// exit with no answer and no line. The running report is cut off (abandoned), and the
/// gateway exits 0.
async fn exit_with_queued(gw: &mut Gateway, up: &Upstream, store: &str) {
    start_reports(gw, 1);
    up.wait_current("/reports/generate", 1).await;
    let c = client();
    let queued: Vec<_> = (0..3)
        .map(|_| spawn_post_answer(&c, gw.url("/reports/generate"), "waiting-key"))
        .collect();
    wait_metric(
        gw,
        r#"tollgate_queued{route="/reports/generate"}"#,
        3.0,
        Duration::from_secs(5),
    )
    .await;
    gw.signal("TERM");
    for q in queued {
        assert_answered_as_exiting(q.await.unwrap(), store);
    }
    assert_eq!(
        gw.wait_exit(Duration::from_secs(5)),
        Some(0),
        "{store}: {}",
        gw.log()
    );
    assert_eq!(up.count("/reports/generate"), 1, "{store}");
    let lines: Vec<_> = gw
        .access_log()
        .into_iter()
        .filter(|l| l["status"] == 503)
        .collect();
    assert_eq!(lines.len(), 3, "{store}: {}", gw.log());
    for l in lines {
        assert_eq!(l["decision"], "route_busy", "{store}: {l}");
        // Queued before the signal, answered at the grace period's end.
        let queued = l["queue_ms"].as_f64().unwrap();
        assert!(queued >= 990.0, "{store}: {l}");
    }
}

/// (d'') Requests still queued when an instance exits past its grace period never ran: each
/// is answered (503, see `exit_with_queued`) and gets its charge back (DESIGN §3: refunded
/// when it leaves the queue without running), as if its client had left; on memory, Redis
/// and the `local` fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exit_past_the_grace_period_answers_and_refunds_the_requests_still_queued() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(4));
    let body = store_body(&redis, "deny", 1, &one_slot_queued());
    let mut a = Gateway::start_with_grace(&up, &body, "1s");
    exit_with_queued(&mut a, &up, "redis").await;
    let b = Gateway::start(&up, &body);
    // The key's 120 units are whole again but for the request that reads them (116: the
    // three kept).
    let r = get(&client(), b.url("/items"), "waiting-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("119"));

    let up = Upstream::start(Duration::from_secs(4));
    let mut a = Gateway::start_with_grace(&up, &one_slot_queued(), "1s");
    exit_with_queued(&mut a, &up, "memory").await;

    // Nothing listens on port 1: the local fallback decides, its share the whole budget.
    let local = "store:\n  backend: redis\n  url: \"redis://127.0.0.1:1/0\"\n  timeout: 100ms\n  on_error: local\n  fleet_size: 1\n";
    let up = Upstream::start(Duration::from_secs(4));
    let mut a = Gateway::start_with_grace(&up, &format!("{local}{}", one_slot_queued()), "1s");
    exit_with_queued(&mut a, &up, "local").await;
}

/// (e) A Redis that stops and continues every 0.6 s, two gateways sending all the time: the
/// key gets at most its budget over the run plus the two local shares.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flapping_redis_keeps_the_budget_plus_one_burst() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // 20 units per 2 s: a burst of 20 and 10 units/s. Local shares: 10 + 10.
    let body = store_body(
        &redis,
        "local",
        2,
        "rate_limits:\n  default: {cost: 1, window: 2s, max_cost: 20}\n",
    );
    let gws = [Gateway::start(&up, &body), Gateway::start(&up, &body)];
    let run_for = Duration::from_secs(6);
    let start = Instant::now();
    let pid = redis.pid();
    let flapper = std::thread::spawn(move || {
        let kill = |sig: &str| {
            std::process::Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status()
                .unwrap();
        };
        while start.elapsed() < run_for {
            kill("STOP");
            std::thread::sleep(Duration::from_millis(600));
            kill("CONT");
            std::thread::sleep(Duration::from_millis(600));
        }
    });
    let c = client();
    let senders = (0..6).map(|i| {
        let c = c.clone();
        let url = gws[i % 2].url("/items");
        async move {
            let mut ok = 0u64;
            while start.elapsed() < run_for {
                let r = get(&c, url.clone(), "k").await;
                match r.status().as_u16() {
                    200 => ok += 1,
                    429 => {}
                    s => panic!("status {s}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ok
        }
    });
    let admitted: u64 = futures_util::future::join_all(senders).await.iter().sum();
    let elapsed = start.elapsed().as_secs_f64();
    flapper.join().unwrap();
    assert_eq!(up.count("/items"), admitted);
    let fallback = fleet_metric(
        &gws,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
    )
    .await;
    assert!(fallback > 0.0, "the fallback decided some");
    // Budget over the run (burst + rate × time) plus the two local shares.
    let bound = 20.0 + 10.0 * elapsed + 20.0;
    eprintln!(
        "admitted {admitted} ({fallback} on the fallback), bound {bound:.1} over {elapsed:.2}s"
    );
    assert!(
        admitted as f64 <= bound.ceil(),
        "admitted {admitted} > {bound:.1} over {elapsed:.2}s"
    );
}

/// `/readyz` follows the store while no request comes (DESIGN §5: "store reachable or a
/// fallback policy in force"): under `on_error: deny` an idle instance whose Redis went away
/// turns not-ready (and `tollgate_store_degraded` 1) by itself, and ready again when Redis is
/// back, so that a load balancer stops sending it requests it could only refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_instance_sees_its_store_go_and_come_back() {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &ten_an_hour_or_deny(&redis));
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    // `/readyz` answers `want`, and the degraded gauge says `degraded`, within 5 s.
    let becomes = async |want: u16, degraded: f64| {
        eventually(Duration::from_secs(5), async || {
            let s = reqwest::get(gw.admin("/readyz")).await.unwrap().status();
            match s.as_u16() == want {
                true => Ok(()),
                false => Err(format!("readyz {s}, not {want}")),
            }
        })
        .await;
        assert_metric(&gw, "tollgate_store_degraded", degraded).await;
    };
    becomes(200, 0.0).await;
    redis.kill();
    becomes(503, 1.0).await;
    let _redis = Redis::start_on(port);
    becomes(200, 0.0).await;
}

/// A store error's cause reaches the log (once, not per request), and `/readyz` sees a store
/// that is unusable from the start, before any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_unusable_at_start_is_logged_with_its_cause_and_not_ready() {
    let redis = Redis::start_with(free_port(), &["--requirepass", "s3cret-pw"]);
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &ten_an_hour_or_deny(&redis));
    let start = Instant::now();
    loop {
        let r = reqwest::get(gw.admin("/readyz")).await.unwrap();
        if r.status() == 503 {
            let v: serde_json::Value = r.json().await.unwrap();
            assert!(v["store"].as_str().unwrap().starts_with("degraded"), "{v}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "readyz never saw it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gw.wait_log("NOAUTH").await;
    let c = client();
    for _ in 0..6 {
        assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 503);
    }
    let log = gw.log();
    let warnings = log
        .lines()
        .filter(|l| l.contains("store unreachable"))
        .count();
    assert!((1..=2).contains(&warnings), "{warnings} warnings:\n{log}");
    assert!(!log.contains("s3cret-pw"));
}

/// `/admin/keys/{id}` while Redis is away: under `on_error: deny`, a 503 that says so (not
/// figures made up, nor a hang); under `local`, the local share in force, marked `"source":
/// "local"`. The shared budget (`"source": "store"`) again once Redis is back.
async fn the_admin_view_of_a_key_while_redis_is_away(on_error: &str) {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            "{}keys:\n  - {{id: k-id, sha256: \"{}\"}}\n",
            store_body(
                &redis,
                on_error,
                2,
                "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
            ),
            sha256_hex("k")
        ),
    );
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    let v = admin_json(&gw, "/admin/keys/k-id").await;
    assert_eq!(
        (&v["remaining"], &v["source"]),
        (&9.into(), &"store".into()),
        "{v}"
    );
    redis.kill();
    let r = reqwest::get(gw.admin("/admin/keys/k-id")).await.unwrap();
    let mut written_back = 0;
    if on_error == "deny" {
        assert_eq!(r.status(), 503);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"], "store unavailable", "{v}");
    } else {
        // This instance's share of 10 across 2, untouched so far; then one unit of it spent.
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(
            (&v["source"], &v["limit"], &v["remaining"]),
            (&"local".into(), &5.into(), &5.into()),
            "{v}"
        );
        assert_eq!(v["budgets"][0]["limit"], 5, "{v}");
        assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
        let v = admin_json(&gw, "/admin/keys/k-id").await;
        assert_eq!(
            (&v["source"], &v["remaining"]),
            (&"local".into(), &4.into()),
            "{v}"
        );
        written_back = 1;
    }
    let _redis = Redis::start_on(port);
    let start = Instant::now();
    loop {
        // A Redis that restarted empty: the whole budget, less what the fallback wrote back.
        let r = reqwest::get(gw.admin("/admin/keys/k-id")).await.unwrap();
        let status = r.status();
        let v: serde_json::Value = r.json().await.unwrap();
        if status == 200 && v["source"] == "store" && v["remaining"] == 10 - written_back {
            assert_eq!(v["limit"], 10, "{v}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the admin view never came back ({status} {v})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_view_of_a_key_says_when_the_store_is_away() {
    the_admin_view_of_a_key_while_redis_is_away("deny").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_view_of_a_key_shows_the_local_share_while_the_store_is_away() {
    the_admin_view_of_a_key_while_redis_is_away("local").await;
}

/// On the `local` fallback every rate-limit figure describes the budget in force, this
/// instance's share (`max_cost / fleet_size`): `X-RateLimit-Limit` and `RateLimit-Policy`'s
/// `q` as well as the units left, for a plan of several budgets and for the default one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_local_fallback_headers_describe_the_local_share() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = store_body(
        &redis,
        "local",
        2,
        &format!(
            "rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 10}}\nplans:\n  pro:\n    budgets:\n      - {{ name: minute, max_cost: 50, window: 60s }}\n      - {{ name: day, max_cost: 30, window: 24h }}\nkeys:\n  - {{ id: acme, sha256: \"{}\", plan: pro }}\n  - {{ id: other, sha256: \"{}\" }}\n",
            sha256_hex("acme-key"),
            sha256_hex("other-key")
        ),
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let r = get(&c, gw.url("/items"), "acme-key").await;
    assert_eq!(
        header(&r, "X-RateLimit-Limit").as_deref(),
        Some("30"),
        "fleet-wide on Redis"
    );
    redis.kill();

    // 50 and 30 across two instances: 25 and 15 here; the day share is the tightest.
    let r = get(&c, gw.url("/items"), "acme-key").await;
    assert_eq!(r.status(), 200);
    assert_metric(
        &gw,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
        1.0,
    )
    .await;
    assert_eq!(
        header(&r, "RateLimit-Policy").as_deref(),
        Some("\"pro-minute\";q=25;w=60, \"pro-day\";q=15;w=86400")
    );
    let rl = header(&r, "RateLimit").unwrap();
    assert!(
        rl.starts_with("\"pro-minute\";r=24;t=") && rl.contains(", \"pro-day\";r=14;t="),
        "{rl}"
    );
    assert_eq!(header(&r, "X-RateLimit-Limit").as_deref(), Some("15"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("14"));
    // A refusal on the share says the same.
    for _ in 0..14 {
        assert_eq!(get(&c, gw.url("/items"), "acme-key").await.status(), 200);
    }
    let r = get(&c, gw.url("/items"), "acme-key").await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "X-RateLimit-Limit").as_deref(), Some("15"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("0"));

    // One budget: 10 across two instances, 5 here.
    let r = get(&c, gw.url("/items"), "other-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "RateLimit-Policy").as_deref(),
        Some("\"default\";q=5;w=3600")
    );
    assert_eq!(header(&r, "X-RateLimit-Limit").as_deref(), Some("5"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("4"));
}

/// A client that leaves while its request waits in the `local` fallback's queue is logged as
/// decided under `on_error` (DESIGN §5's access line: `fallback`), as every other request of
/// the outage is. It said `"fallback": false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_the_fallbacks_queue_is_logged_on_the_fallback() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::from_millis(3000));
    let caps = "      max_in_flight: 1\n      queue_timeout: 10s\n";
    let gw = Gateway::start(
        &up,
        &store_body(&redis, "local", 1, &incident_with_report_caps(caps)),
    );
    redis.kill();
    let holder = tokio::spawn({
        let url = gw.url("/reports/generate");
        async move { post(&client(), url, "holder").await.status() }
    });
    up.wait_current("/reports/generate", 1).await;
    let left = impatient(Duration::from_millis(800))
        .post(gw.url("/reports/generate"))
        .header("X-API-Key", "leaver")
        .send()
        .await;
    assert!(left.is_err(), "queued past the client's patience");
    let gone = gw.wait_access(1, |l| l["decision"] == "client_gone").await;
    assert_eq!(gone[0]["fallback"], true, "{}", gone[0]);
    assert_eq!(holder.await.unwrap(), 200);
    let ran = gw.wait_access(1, |l| l["decision"] == "admitted").await;
    assert_eq!(ran[0]["fallback"], true, "{}", ran[0]);
}
