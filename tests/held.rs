//! Requests held for their `max_delay` turn on a capped route (README "When a route is
//! full"): held before they join the route's queue, never keeping a slot idle, on the memory
//! store, Redis and the `local` fallback; their key's slot kept, their charge given back when
//! they are not served, and their hold told apart from queue time.

mod common;

use std::time::{Duration, Instant};

use common::four_keys as config;
use common::*;

const ROUTE: &str = "/reports/generate";

fn on_redis(url: &str, body: &str) -> String {
    format!("store:\n  backend: redis\n  url: \"{url}\"\n  timeout: 250ms\n  on_error: deny\n  lease_ttl: 1s\n{body}")
}

/// Redis unreachable from the start (nothing listens on port 1): the `local` fallback decides,
/// `fleet_size: 1` (the local share is the whole budget and cap).
const LOCAL: &str = "store:\n  backend: redis\n  url: \"redis://127.0.0.1:1/0\"\n  timeout: 100ms\n  on_error: local\n  fleet_size: 1\n";

const ONE_SLOT: &str =
    "    /reports/generate:\n      cost: 1\n      max_in_flight: 1\n      queue_timeout: 30s\n";
const FIVE_SLOTS: &str =
    "    /reports/generate:\n      cost: 1\n      max_in_flight: 5\n      queue_timeout: 30s\n";

/// Key c: one unit per 6 s, held up to 20 s for its turn. Key d: plenty.
const HELD: &str = "plans:\n  gold: {max_cost: 1, window: 6s, max_delay: 20s}\n  basic: {max_cost: 1000, window: 24h}\n";

/// An access-log line's `hold_ms` and `queue_ms`.
fn hold_and_queue_ms(line: &serde_json::Value) -> (f64, f64) {
    (
        line["hold_ms"].as_f64().unwrap(),
        line["queue_ms"].as_f64().unwrap(),
    )
}

/// A held job's end line's `hold_ms` is what key c's schedule made it: its unit due 6 s (the
/// plan's window) after the key's first charge, which came after `charged`, counted from the
/// job's own charge, which came before `submitted` (time since `charged`); rounded up to the
/// millisecond at most.
fn assert_held_for_its_turn(line: &serde_json::Value, submitted: Duration, store: &str) {
    let (hold, _) = hold_and_queue_ms(line);
    let least = 6000.0 - submitted.as_secs_f64() * 1000.0;
    assert!(
        (least - 1.0..=6002.0).contains(&hold),
        "{store}: {least} {line}"
    );
}

/// The keys of the reports the upstream received, in order.
fn keys_seen(up: &Upstream) -> Vec<String> {
    up.api
        .seen()
        .iter()
        .filter(|s| s.target.starts_with(ROUTE))
        .map(|s| s.header("x-api-key")[0].to_string())
        .collect()
}

/// When key `id`'s first budget is full again, from `/admin/keys/<id>` (s).
async fn reset(gw: &Gateway, id: &str) -> u64 {
    let v = admin_json(gw, &format!("/admin/keys/{id}")).await;
    v["budgets"][0]["reset_seconds"].as_u64().unwrap_or(0)
}

/// Waits until key `id`'s budget is full again only more than `s` seconds from now: a request
/// charged (and held) beyond what the budget held.
async fn wait_reset_above(gw: &Gateway, id: &str, s: u64) {
    eventually(Duration::from_secs(10), async || {
        match reset(gw, id).await {
            r if r > s => Ok(()),
            r => Err(format!("reset {r}")),
        }
    })
    .await;
}

/// Key c's plan holds its requests (`max_delay`): one unit per 6 s. Its second report is
/// charged at once and held ~6 s until its unit is due, while the route's only slot is free.
/// Key b's report, sent meanwhile, runs at once: the held request waits for its units before
/// it joins the route's queue, so it never keeps a slot idle (DESIGN §8: one customer's
/// requests never make another's wait behind them). Then c's report runs, after its hold; and
/// a held request whose client leaves is never forwarded and gets its units back.
async fn a_held_request_holds_no_slot(up: &Upstream, gws: &[Gateway], store: &str) {
    let c = client();
    let (gw_c, gw_b) = (&gws[0], &gws[gws.len() - 1]);
    assert_eq!(
        post(&c, gw_c.url(ROUTE), "key-c").await.status(),
        200,
        "{store}"
    );
    let sent = Instant::now();
    let held = tokio::spawn({
        let (c, url) = (c.clone(), gw_c.url(ROUTE));
        async move {
            let status = post(&c, url, "key-c").await.status().as_u16();
            (status, sent.elapsed())
        }
    });
    // Charged (its unit reserved: the budget is full again only ~12 s from now) and held.
    wait_reset_above(gw_c, "c", 6).await;
    let t = Instant::now();
    assert_eq!(
        post(&c, gw_b.url(ROUTE), "key-b").await.status(),
        200,
        "{store}"
    );
    let b_took = t.elapsed();
    let (status, c_took) = held.await.unwrap();
    assert_eq!(status, 200, "{store}");
    let order = keys_seen(up);
    assert_eq!(order, ["key-c", "key-b", "key-c"], "{store}");
    assert!(
        b_took < Duration::from_secs(3),
        "{store}: b took {b_took:?}"
    );
    assert!(
        c_took >= Duration::from_secs(4),
        "{store}: c's hold {c_took:?}"
    );
    assert_eq!(up.max_concurrent(ROUTE), 1, "{store}");

    // Held again (its unit due ~6 s from now), then the client leaves: never forwarded, and
    // its unit given back (the budget is full again within ~6 s, not ~12 s).
    let gone = spawn_post(&c, gw_c.url(ROUTE), "key-c");
    wait_reset_above(gw_c, "c", 6).await;
    gone.abort();
    eventually(Duration::from_secs(10), async || {
        match reset(gw_c, "c").await {
            r if r <= 6 => Ok(()),
            r => Err(format!("{store}: reset {r} after the client left")),
        }
    })
    .await;
    assert_eq!(up.count(ROUTE), 3, "{store}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_request_holds_no_slot_on_memory_redis_and_the_local_fallback() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(ONE_SLOT, HELD));
    a_held_request_holds_no_slot(&up, &[gw], "memory").await;

    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = on_redis(&redis.url(), &config(ONE_SLOT, HELD));
    let gws: Vec<Gateway> = (0..2).map(|_| Gateway::start(&up, &body)).collect();
    a_held_request_holds_no_slot(&up, &gws, "2 gateways on redis").await;

    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &format!("{LOCAL}{}", config(ONE_SLOT, HELD)));
    a_held_request_holds_no_slot(&up, &[gw], "local fallback").await;
}

/// Three requests of key c held on `x` for their turns (6, 12 and 18 s away), then `x` exits
/// by `signal`: each is answered 503 `route-busy` at once and its unit given back (as for a
/// request held after admission, `budgets::an_exiting_gateway_gives_back_the_turns_it_holds`),
/// read on `y`. Meanwhile none held a slot: another key's report ran at once.
async fn exit_while_held(x: &mut Gateway, y: &Gateway, signal: &str) {
    let c = client();
    assert_eq!(post(&c, x.url(ROUTE), "key-c").await.status(), 200);
    let held: Vec<_> = (0..3)
        .map(|_| spawn_post_answer(&c, x.url(ROUTE), "key-c"))
        .collect();
    // All three charged (the budget full again in ~24 s).
    wait_reset_above(y, "c", 18).await;
    let t = Instant::now();
    assert_eq!(post(&c, y.url(ROUTE), "key-b").await.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let t = Instant::now();
    x.signal(signal);
    for h in held {
        assert_answered_as_exiting(h.await.unwrap(), signal);
    }
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "{signal}: {:?}",
        t.elapsed()
    );
    assert_eq!(x.wait_exit(Duration::from_secs(10)), Some(0), "{signal}");
    // Their units are back: the budget is full again within the first report's 6 s.
    let reset = reset(y, "c").await;
    assert!(reset <= 6, "{signal}: reset {reset}");
}

/// SIGTERM with the turns past the grace period; SIGINT (the fast exit) with Redis a network
/// away (100 ms each way): the exit waits for the held requests' answers and refunds (a
/// review found them cut off by the exit: connection errors, the units kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exiting_gateway_answers_and_gives_back_the_capped_requests_it_holds() {
    let plan = "plans:\n  gold: {max_cost: 1, window: 6s, max_delay: 60s}\n  basic: {max_cost: 1000, window: 24h}\n";
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = on_redis(&redis.url(), &config(ONE_SLOT, plan));
    let mut x = Gateway::start_with_grace(&up, &body, "1s");
    let y = Gateway::start(&up, &body);
    exit_while_held(&mut x, &y, "TERM").await;
    assert_eq!(up.count(ROUTE), 2);

    let redis = Redis::start();
    let far = Proxy::start_delayed(redis.port, Duration::from_millis(100));
    let up = Upstream::start(Duration::ZERO);
    let store = |port: u16| {
        let url = format!("redis://127.0.0.1:{port}/0");
        on_redis(&url, &config(ONE_SLOT, plan)).replace("timeout: 250ms", "timeout: 1s")
    };
    let mut x = Gateway::start(&up, &store(far.port));
    let y = Gateway::start(&up, &store(redis.port));
    exit_while_held(&mut x, &y, "INT").await;
    assert_eq!(up.count(ROUTE), 2);
}

/// The report route with one slot, async, its jobs' `result_ttl` (2 s) shorter than key c's
/// hold.
const ONE_SLOT_ASYNC: &str = "    /reports/generate:\n      cost: 1\n      max_in_flight: 1\n      queue_timeout: 30s\n      async:\n        result_ttl: 2s\n";

/// Key c's job is held ~6 s for its turn (`max_delay`). It waits at its place in the route's
/// queue without a slot: key b's report, sent right after the job's 202, runs at once (the
/// job took the route's only slot and held it for its whole hold: b waited ~6 s). The job
/// runs once its units are due, not sooner, and does not expire (its `result_ttl` counts from
/// then); its last access-log line counts the hold as `hold_ms`, not as `queue_ms`.
async fn a_held_job_holds_no_slot(up: &Upstream, gws: &[Gateway], store: &str) {
    let c = client();
    let (x, y) = (&gws[0], &gws[gws.len() - 1]);
    let charged = Instant::now();
    assert_eq!(
        post(&c, x.url(ROUTE), "key-c").await.status(),
        200,
        "{store}"
    );
    let r = post_async(&c, x.url(ROUTE), "key-c", "", &[]).await;
    let submitted = charged.elapsed();
    assert_eq!(r.status(), 202, "{store}");
    let location = job_location(&r);
    let t = Instant::now();
    assert_eq!(
        post(&c, y.url(ROUTE), "key-b").await.status(),
        200,
        "{store}"
    );
    let b_took = t.elapsed();
    assert!(
        b_took < Duration::from_secs(3),
        "{store}: b took {b_took:?}"
    );
    let within = Duration::from_secs(20);
    let done = job_result(&c, y, &location, "key-c", within, |_| {}).await;
    assert_eq!(done.status(), 200, "{store}");
    // Its unit is due 6 s after the first one's charge, which came after `charged`.
    let ran = charged.elapsed();
    assert!(ran >= Duration::from_secs(6), "{store}: ran after {ran:?}");
    let order = keys_seen(up);
    assert_eq!(order, ["key-c", "key-b", "key-c"], "{store}");
    assert_eq!(up.max_concurrent(ROUTE), 1, "{store}");
    let id = location.trim_start_matches("/_tollgate/jobs/").to_string();
    let line = eventually(Duration::from_secs(10), async || {
        let lines: Vec<_> = gws
            .iter()
            .flat_map(|g| g.access_log())
            .filter(|l| l["decision"] == "job_done" && l["job"] == id.as_str())
            .collect();
        lines
            .first()
            .cloned()
            .ok_or(format!("{store}: no job_done line"))
    })
    .await;
    assert_held_for_its_turn(&line, submitted, store);
    let (_, queue) = hold_and_queue_ms(&line);
    assert!(queue < 1000.0, "{store}: {line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_job_holds_no_slot_on_memory_and_redis() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(ONE_SLOT_ASYNC, HELD));
    a_held_job_holds_no_slot(&up, &[gw], "memory").await;

    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = on_redis(&redis.url(), &config(ONE_SLOT_ASYNC, HELD));
    let gws: Vec<Gateway> = (0..2).map(|_| Gateway::start(&up, &body)).collect();
    a_held_job_holds_no_slot(&up, &gws, "2 gateways on redis").await;
}

/// On Redis the fleet's collectors expire a queued job that has waited its `result_ttl` (and
/// refund it) whether or not anyone polls it, oldest first. A job held for its turn ahead of
/// it no longer stops that look (its `result_ttl` counts from its due time, so it was not
/// overdue, and the look stopped there): key b's job, queued behind key d's report that holds
/// the only slot, is refunded about `result_ttl` (2 s) after it was queued, though key c's
/// held job is older in the queue. (It was refunded only once c's job was out of the way.)
/// Then c's job, due at 6 s with the slot still taken, expires after its own `result_ttl`:
/// its end line counts its hold as `hold_ms` and its wait after it as `queue_ms` (on Redis an
/// unrun job's line put it all in `queue_ms`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_job_does_not_hold_up_the_expiry_of_the_jobs_behind_it() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &on_redis(&redis.url(), &config(ONE_SLOT_ASYNC, HELD)));
    let c = client();
    let charged = Instant::now();
    assert_eq!(post(&c, gw.url(ROUTE), "key-c").await.status(), 200);
    // Key d's report holds the only slot for 12 s.
    let _slow = spawn_post(&c, gw.url(&format!("{ROUTE}?delay_ms=12000")), "key-d");
    up.wait_current(ROUTE, 1).await;
    let held = post_async(&c, gw.url(ROUTE), "key-c", "", &[]).await;
    let submitted = charged.elapsed();
    assert_eq!(held.status(), 202);
    let queued = post_async(&c, gw.url(ROUTE), "key-b", "", &[]).await;
    assert_eq!(queued.status(), 202);
    let t = Instant::now();
    assert_eq!(remaining(&gw, "b").await, 999);
    eventually(Duration::from_secs(15), async || {
        match remaining(&gw, "b").await {
            1000 => Ok(()),
            r => Err(format!("key b's job still charged: {r} left")),
        }
    })
    .await;
    // Its result_ttl, then the next look (every second): not c's hold (6 s) first.
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(4500),
        "refunded after {took:?}"
    );
    assert_eq!(up.count(ROUTE), 2, "neither job ran");
    let id = job_location(&held)
        .trim_start_matches("/_tollgate/jobs/")
        .to_string();
    let expired = gw
        .wait_access(1, |l| {
            l["decision"] == "job_expired" && l["job"] == id.as_str()
        })
        .await;
    assert_held_for_its_turn(&expired[0], submitted, "redis");
    let (_, queue) = hold_and_queue_ms(&expired[0]);
    assert!((1500.0..4500.0).contains(&queue), "{}", expired[0]);
    assert_eq!(up.count(ROUTE), 2, "neither job ran");
}

/// Key c may run one request at a time (`max_in_flight_per_key: 1`) and its plan holds its
/// requests (one unit per 10 s). Its second report is charged and held ~10 s for its turn:
/// meanwhile the key is at its cap, so its third is refused at once (429
/// `concurrency-limit`), and so is a fourth sent after three times `lease_ttl` (1 s on Redis:
/// the held request's key lease is renewed while it is held, it lapsed before), on memory,
/// Redis and the local fallback (where the key's share was taken only after the hold: the 429
/// came after it, ~10 s late).
async fn a_held_request_keeps_its_keys_slot(gw: &Gateway, store: &str) {
    let c = client();
    assert_eq!(
        post(&c, gw.url(ROUTE), "key-c").await.status(),
        200,
        "{store}"
    );
    let held = spawn_post(&c, gw.url(ROUTE), "key-c");
    wait_reset_above(gw, "c", 10).await;
    let charged = Instant::now();
    let t = Instant::now();
    let r = post(&c, gw.url(ROUTE), "key-c").await;
    assert_eq!(r.status(), 429, "{store}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "{store}: {:?}",
        t.elapsed()
    );
    let body = r.text().await.unwrap();
    assert!(body.contains("concurrency-limit"), "{store}: {body}");
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(charged.elapsed())).await;
    assert_eq!(
        post(&c, gw.url(ROUTE), "key-c").await.status(),
        429,
        "{store}"
    );
    assert_eq!(held.await.unwrap(), 200, "{store}");
}

const KEY_CAPPED: &str = "plans:\n  gold: {max_cost: 1, window: 10s, max_delay: 30s, max_in_flight_per_key: 1}\n  basic: {max_cost: 1000, window: 24h}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_request_keeps_its_keys_slot_on_memory_redis_and_the_local_fallback() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(FIVE_SLOTS, KEY_CAPPED));
    a_held_request_keeps_its_keys_slot(&gw, "memory").await;

    let redis = Redis::start();
    let gw = Gateway::start(
        &up,
        &on_redis(&redis.url(), &config(FIVE_SLOTS, KEY_CAPPED)),
    );
    a_held_request_keeps_its_keys_slot(&gw, "redis").await;

    let gw = Gateway::start(&up, &format!("{LOCAL}{}", config(FIVE_SLOTS, KEY_CAPPED)));
    a_held_request_keeps_its_keys_slot(&gw, "local fallback").await;
}

/// Key c's report is held ~6 s on Redis for its turn while key d's 12 s report has the route's
/// only slot; Redis dies during the hold, and `on_error: local` decides c after it. Its
/// `queue_timeout` (8 s) counts from the end of its hold, there too: it waits for d's slot and
/// runs (it was refused at ~8 s, its queue time spent by its hold), and its log line tells its
/// hold from its queue time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_is_not_queue_time_when_redis_dies_during_it() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let route =
        "    /reports/generate:\n      cost: 1\n      max_in_flight: 1\n      queue_timeout: 8s\n";
    let body = on_redis(&redis.url(), &config(route, HELD))
        .replace("on_error: deny", "on_error: local\n  fleet_size: 1");
    let gw = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(post(&c, gw.url(ROUTE), "key-c").await.status(), 200);
    let d = spawn_post(&c, gw.url(&format!("{ROUTE}?delay_ms=12000")), "key-d");
    up.wait_current(ROUTE, 1).await;
    let held = spawn_post(&c, gw.url(ROUTE), "key-c");
    wait_reset_above(&gw, "c", 6).await;
    redis.kill();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(d.await.unwrap(), 200);
    let lines = gw.wait_access(3, |l| l["route"] == ROUTE).await;
    let c2 = &lines[2];
    assert_eq!(
        (&c2["key"], &c2["status"]),
        (&"c".into(), &200.into()),
        "{c2}"
    );
    let (hold, queue) = hold_and_queue_ms(c2);
    assert!(hold > 4000.0 && queue > 2000.0 && queue < 8000.0, "{c2}");
}

/// A held request whose client leaves mid-hold, and one held then admitted, on the memory
/// store: their log lines say they were held (`hold_ms`), not queued, and
/// `tollgate_queue_wait_seconds` counts no hold (the first was logged as queued for its hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_before_the_queue_is_logged_as_a_hold() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config(ONE_SLOT, HELD));
    let c = client();
    assert_eq!(post(&c, gw.url(ROUTE), "key-c").await.status(), 200);
    let gone = impatient(Duration::from_secs(2))
        .post(gw.url(ROUTE))
        .header("X-API-Key", "key-c")
        .send()
        .await;
    assert!(gone.is_err());
    let lines = gw.wait_access(2, |l| l["key"] == "c").await;
    let left = &lines[1];
    let (hold, queue) = hold_and_queue_ms(left);
    assert!(hold > 1500.0 && queue < 500.0, "{left}");
    // Its unit given back; the first's is due ~4 s from now: one more, held.
    let held = spawn_post(&c, gw.url(ROUTE), "key-c");
    assert_eq!(held.await.unwrap(), 200);
    let lines = gw.wait_access(3, |l| l["key"] == "c").await;
    let admitted = &lines[2];
    let (hold, queue) = hold_and_queue_ms(admitted);
    assert!(hold > 1000.0 && queue < 500.0, "{admitted}");
    let sum = metric(
        &gw,
        &format!("tollgate_queue_wait_seconds_sum{{route=\"{ROUTE}\"}}"),
    )
    .await;
    assert!(sum < 1.0, "queue wait {sum} s");
}

/// A request Redis charged and held for its turn goes out on that schedule when Redis dies
/// during the hold (`on_error: local`, two instances: this one's share is half the budget):
/// its turn came, so the local share takes its units without deciding again. It was decided
/// again: held a second time until the share (full with the key's earlier requests) had room,
/// or refused with 429 after its hold when the share could not hold it (probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_redis_scheduled_goes_out_at_its_turn_when_redis_dies_meanwhile() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let plan = "plans:\n  gold: {max_cost: 2, window: 20s, max_delay: 30s}\n  basic: {max_cost: 1000, window: 24h}\n";
    let body = on_redis(&redis.url(), &config(ONE_SLOT, plan))
        .replace("on_error: deny", "on_error: local\n  fleet_size: 2");
    let gw = Gateway::start(&up, &body);
    let c = client();
    for _ in 0..2 {
        assert_eq!(post(&c, gw.url(ROUTE), "key-c").await.status(), 200);
    }
    // The third is due 10 s from now (one unit back every 10 s).
    let sent = Instant::now();
    let third = spawn_post(&c, gw.url(ROUTE), "key-c");
    wait_reset_above(&gw, "c", 20).await;
    redis.kill();
    assert_eq!(third.await.unwrap(), 200);
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_secs(8) && took < Duration::from_secs(15),
        "{took:?}"
    );
    assert_eq!(up.count(ROUTE), 3);
}

/// Redis restarts without its data while key c's request is held on `x` (its plan: one at a
/// time, `max_in_flight_per_key: 1`): `x` registers the held request's key lease again, as it
/// does for the leases of running requests (DESIGN §4: the caps are exact again within 2 s),
/// so c's next request, on `y` 3 s later, is 429 `concurrency-limit` (it was admitted: the
/// held request's lease was not registered anywhere; its renewal made it again 5 s later, one
/// request too late).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_requests_key_lease_is_registered_again_after_redis_lost_its_data() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let plan = "plans:\n  gold: {max_cost: 1, window: 20s, max_delay: 60s, max_in_flight_per_key: 1}\n  basic: {max_cost: 1000, window: 24h}\n";
    // The default lease_ttl (15 s): renewals every 5 s.
    let body = on_redis(&redis.url(), &config(FIVE_SLOTS, plan)).replace("  lease_ttl: 1s\n", "");
    let x = Gateway::start(&up, &body);
    let y = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(post(&c, x.url(ROUTE), "key-c").await.status(), 200);
    let held = spawn_post(&c, x.url(ROUTE), "key-c");
    wait_reset_above(&x, "c", 20).await;
    let port = redis.port;
    redis.kill();
    let _redis = Redis::start_on(port);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = post(&c, y.url(ROUTE), "key-c").await;
    let status = r.status();
    assert_eq!(status, 429, "{}", r.text().await.unwrap());
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(up.count(ROUTE), 2);
}

/// Redis goes away (killed; it comes back with its data, kept in an append-only file) just
/// after it charged and held key c's fifth request, for longer than one unit takes to drain
/// (4 s) but not the five its bucket holds (20 s): the request goes out at its turn on the
/// local share, and the charge Redis holds goes back once Redis is there again (the local one
/// is written back instead), so the key is charged once. The refund was given up after one
/// unit's drain time: charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_request_is_charged_once_through_a_long_redis_outage() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().unwrap().to_string();
    let kept = [
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        &dir,
    ];
    let port = free_port();
    let mut redis = Redis::start_with(port, &kept);
    let up = Upstream::start(Duration::ZERO);
    let plan = "plans:\n  gold: {max_cost: 4, window: 16s, max_delay: 10s}\n  basic: {max_cost: 1000, window: 24h}\n";
    let body = on_redis(&redis.url(), &config(FIVE_SLOTS, plan))
        .replace("on_error: deny", "on_error: local\n  fleet_size: 1");
    let gw = Gateway::start(&up, &body);
    let c = client();
    let t0 = Instant::now();
    for _ in 0..4 {
        assert_eq!(post(&c, gw.url(ROUTE), "key-c").await.status(), 200);
    }
    // The fifth is due 4 s from now; the bucket is full again 20 s from now.
    let fifth = spawn_post(&c, gw.url(ROUTE), "key-c");
    wait_reset_above(&gw, "c", 16).await;
    redis.kill();
    assert_eq!(fifth.await.unwrap(), 200);
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(t0.elapsed())).await;
    let _redis = Redis::start_with(port, &kept);
    // Five units charged at t0, draining at 0.25 a second: full again 20 s after t0 (24 s
    // with a unit charged twice), as Redis says once it answers again.
    eventually(Duration::from_secs(8), async || {
        let v = admin_json(&gw, "/admin/keys/c").await;
        let r = v["budgets"][0]["reset_seconds"].as_f64().unwrap_or(0.0);
        let due = 20.0 - t0.elapsed().as_secs_f64();
        (v["source"] == "store" && r <= due + 1.5 && r >= due - 1.5)
            .then_some(())
            .ok_or(format!("{v}: {due:.1} s expected"))
    })
    .await;
    assert_eq!(up.count(ROUTE), 5);
}
