//! Redis faults that answer instead of going silent (DESIGN §4): an error reply means the
//! script wrote nothing, so what it carried is sent again; and a `maxmemory-policy` that can
//! evict tollgate's keys is said loudly. Real Redis processes, two gateways, ground truth
//! counted at the upstream.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

/// A year's window: what refills during a test is far below one unit.
const MAX: u64 = 50_000;

fn body(redis: &Redis, extra_limits: &str) -> String {
    store_yaml(&redis.url(), extra_limits)
}

/// A gateway on the Redis at `url` (`on_error: local`, two instances, a year's budget).
fn store_yaml(url: &str, extra_limits: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{url}\"\n  timeout: 200ms\n  on_error: local\n  fleet_size: 2\n  lease_ttl: 15s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\n{extra_limits}"
    )
}

/// Units charged to `key` in Redis, read from a probe request (which charges one more, and
/// is counted at the upstream). A probe the local share answered (a connection that broke
/// a moment ago: its limit is the share's) says nothing of Redis: the next one is read.
async fn charged(c: &reqwest::Client, gw: &Gateway, key: &str) -> u64 {
    loop {
        let r = get(c, gw.url("/items"), key).await;
        assert_eq!(r.status(), 200, "probe for {key}");
        if header(&r, "X-RateLimit-Limit") != Some(MAX.to_string()) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let left: u64 = header(&r, "X-RateLimit-Remaining")
            .unwrap()
            .parse()
            .unwrap();
        return MAX - 1 - left;
    }
}

/// Waits (10 s at most) until `key`'s charge in Redis is exactly `admitted()` (read after each
/// probe, which it counts): fallback charges are written back, and calls given up on are
/// undone by their admission ids, within a few hundred ms of Redis answering again, so a
/// reading may be short or, while an undo is on its way, over; the end must be exact.
async fn charged_settles(c: &reqwest::Client, gw: &Gateway, key: &str, admitted: impl Fn() -> u64) {
    let start = Instant::now();
    loop {
        let got = charged(c, gw, key).await;
        // The probe is counted at the upstream (and charged after `got`).
        let want = admitted() - 1;
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "charged {got} for {want} admitted\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the lease set `leases` holds `n` leases, which DESIGN §4 wants within 2 s of the
/// store's return (the instance registers what it admitted while the store was away).
async fn registered_within_2s(redis: &Redis, leases: &str, n: usize) {
    let healed = Instant::now();
    while redis.cli(&["ZCARD", leases]) != n.to_string() {
        assert!(
            healed.elapsed() < Duration::from_secs(2),
            "not registered within 2 s: {}",
            redis.cli(&["ZRANGE", leases, "0", "-1"])
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `maxmemory` at 1 byte with `noeviction`: Redis refuses every script with `-OOM` (they are
/// flagged, so it refuses them before running them), then the limit is lifted. What was
/// decided meanwhile — fallback admissions to write back, charges after the fact
/// (`cost_from_response`) — is sent again, never dropped: the metered key is charged exactly
/// what the upstream ran for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_out_of_memory_redis_loses_no_charge() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let cfg = body(
        &redis,
        "  endpoints:\n    /q: {cost: 1, cost_from_response: X-Actual-Cost}\n",
    );
    let gws: Arc<Vec<Gateway>> = Arc::new((0..2).map(|_| Gateway::start(&up, &cfg)).collect());
    let c = client();
    // Each `/q` costs 3 in the end (1 at admission, 2 stated by the upstream), each
    // `/items` 1. A /q runs 300 ms: admitted before the OOM, its stated cost is charged
    // after the fact while Redis refuses.
    let load = Load::start(&c, &gws, "m", 4, Duration::from_millis(10), |n| {
        if n % 2 == 0 {
            "/q?actual_cost=3&delay_ms=300"
        } else {
            "/items"
        }
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        "OK"
    );
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    let refused = redis.cli(&["SET", "probe", "x"]);
    assert!(refused.starts_with("OOM"), "{refused}");
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    load.stop().await;
    let admitted = |up: &Upstream| 3 * up.count("/q") + up.count("/items");
    let fallback = fleet_metric(
        &gws,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
    )
    .await;
    assert!(
        fallback > 0.0,
        "the OOM was met: requests were decided by the fallback"
    );
    charged_settles(&c, &gws[0], "m", || admitted(&up)).await;
}

/// An evicting `maxmemory-policy` (any but `noeviction`: every tollgate key has a TTL) is an
/// ERROR in the log and `tollgate_store_eviction_unsafe 1`; `noeviction` is neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_reported() {
    let evicting = Redis::start_with(free_port(), &["--maxmemory-policy", "allkeys-lru"]);
    let safe = Redis::start_with(free_port(), &["--maxmemory-policy", "noeviction"]);
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &body(&evicting, ""));
    let b = Gateway::start(&up, &body(&safe, ""));
    wait_metric(
        &a,
        "tollgate_store_eviction_unsafe",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    // The gauge is set just before the error is logged (by the log's writer thread).
    a.wait_log("allkeys-lru").await;
    let errors = error_lines(&a);
    assert!(
        errors
            .iter()
            .any(|l| l.contains("maxmemory-policy") && l.contains("allkeys-lru")),
        "{errors:?}"
    );
    // B read its policy too (its first store call is answered), and found nothing to say.
    assert_eq!(get(&client(), b.url("/items"), "k").await.status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_metric(&b, "tollgate_store_eviction_unsafe", 0.0).await;
    assert!(error_lines(&b).is_empty(), "{:?}", error_lines(&b));
    // Still so while it runs: the gauge follows the policy (read again every minute).
    assert_metric(&a, "tollgate_store_eviction_unsafe", 1.0).await;
}

/// 6 long reports hold a cap of 6 on gateway A; Redis is SIGKILLed and started again, empty,
/// on the same port. A sees the new `run_id` and registers its 6 leases again; B, which also
/// sees it, holds back its requests that take a slot meanwhile. So B's 6 wait for A's to end
/// instead of running beside them: never more than 6 at the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restarted_empty_keeps_the_cap() {
    restarted_empty_keeps_the_cap(true, false).await;
}

/// As above, but B's requests are the first its worker threads send to Redis: each thread
/// connects as its first report asks to be admitted, and learns the new `run_id` only then.
/// Before, the hold was decided before that connection was made: B's first report ran beside
/// A's 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_first_request_after_redis_restarted_empty_holds_back_too() {
    restarted_empty_keeps_the_cap(false, false).await;
}

/// As above, but B's reports are sent the moment Redis is back: each worker thread's
/// connection to the old process still looks open (its watch has not looked since), so the
/// report's charge finds it closed and goes again on a new one, which reads the new `run_id`
/// only then. Before, that report took a slot at once, beside A's 6 (a probe saw 4 of a cap
/// of 3 in half its runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_that_meets_the_restart_on_its_charge_holds_back_too() {
    restarted_empty_keeps_the_cap_at(true, false, true).await;
}

/// As above, but B's 6 were queued before the restart: the queue they waited in is gone, and
/// B put them back as soon as it saw that, before A had its 6 leases registered again (11 at
/// the upstream, every time): they re-enter under the same hold as any request that takes a
/// slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_queued_when_redis_restarted_empty_hold_back_too() {
    restarted_empty_keeps_the_cap(true, true).await;
}

/// Two gateways' config on `redis`, `on_error: deny` (nothing is admitted while Redis is away,
/// only the lost leases matter): `/reports/generate` costs 1, runs `cap` at once and queues
/// for `queue_timeout`; budgets that never run out.
fn reports_on_deny(redis: &Redis, cap: u32, queue_timeout: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: deny\n  fleet_size: 2\n  lease_ttl: 15s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: {cap}, queue_timeout: {queue_timeout}}}\n",
        redis.url()
    )
}

/// Waits (5 s at most) until `gw` admits a request through Redis again (503
/// store-unavailable until then, under `on_error: deny`).
async fn wait_answering(gw: &Gateway) {
    let c = client();
    eventually(Duration::from_secs(5), async || {
        match get(&c, gw.url("/items"), "probe").await.status().as_u16() {
            200 => Ok(()),
            s => Err(format!("Redis not back: {s}")),
        }
    })
    .await;
}

/// A holds a cap of 6 with long reports; Redis restarts empty; B's 6 must wait for A's.
/// `warm`: B's worker threads spoke to the old Redis, and B waits for the new one to answer
/// before sending its reports (its process knew the old `run_id` either way: it read Redis's
/// eviction policy at start).
/// `queued`: B's reports are sent before the restart, and wait in the queue behind A's.
async fn restarted_empty_keeps_the_cap(warm: bool, queued: bool) {
    restarted_empty_keeps_the_cap_at(warm, queued, false).await;
}

/// [`restarted_empty_keeps_the_cap`]; `at_once`: a warm B's reports are sent as soon as Redis
/// listens again, not once B answers through it.
async fn restarted_empty_keeps_the_cap_at(warm: bool, queued: bool, at_once: bool) {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::from_secs(5));
    let cfg = reports_on_deny(&redis, 6, "15s");
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg);
    let c = client();
    if warm {
        // Both know the Redis process before it goes.
        assert_eq!(get(&c, b.url("/items"), "warm").await.status(), 200);
    }
    let first: Vec<_> = (0..6)
        .map(|i| spawn_post(&c, a.url("/reports/generate"), &format!("a{i}")))
        .collect();
    up.wait_current("/reports/generate", 6).await;
    let send_second = || -> Vec<tokio::task::JoinHandle<u16>> {
        // A worker thread whose connection broke with the old Redis finds out on its next
        // call: 503 store-unavailable (deny), never admitted. Sent again.
        (0..6)
            .map(|i| {
                let url = b.url("/reports/generate");
                spawn_post_until_decided(&c, url, &format!("b{i}"))
            })
            .collect()
    };
    let mut second = vec![];
    if queued {
        second = send_second();
        wait_metric(
            &b,
            r#"tollgate_queued{route="/reports/generate"}"#,
            6.0,
            Duration::from_secs(5),
        )
        .await;
    }
    redis.kill();
    redis = Redis::start_on(port);
    // Restarted empty: a new process that keeps nothing on disk. (Its DBSIZE would race A,
    // which may register its leases again the moment the port opens.)
    assert_eq!(
        redis.cli(&["CONFIG", "GET", "appendonly"]),
        "appendonly\nno"
    );
    assert_eq!(redis.cli(&["CONFIG", "GET", "save"]).trim(), "save");
    if warm && !at_once {
        // B's requests once Redis answers it again (503 store-unavailable until then).
        wait_answering(&b).await;
    }
    if !queued {
        second = send_second();
    }
    for t in first.into_iter().chain(second) {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(up.count("/reports/generate"), 12);
    assert_eq!(
        up.max_concurrent("/reports/generate"),
        6,
        "A's leases were registered again before B filled the cap\n{}",
        a.log()
    );
}

/// After Redis restarted empty, a request that would take a slot waits while the other
/// instances register their leases again — within its `queue_timeout`, not before it: B's
/// report, on a route A fills, is refused once its 2 s are up (it waited those 2 s, then 2 s
/// more in the queue: 4 s in all).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hold_after_redis_restarted_empty_counts_in_the_queue_timeout() {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::from_secs(8));
    let cfg = reports_on_deny(&redis, 2, "2s");
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg);
    let c = client();
    assert_eq!(get(&c, b.url("/items"), "warm").await.status(), 200);
    let first: Vec<_> = (0..2)
        .map(|i| spawn_post(&c, a.url("/reports/generate"), &format!("a{i}")))
        .collect();
    up.wait_current("/reports/generate", 2).await;
    redis.kill();
    let _redis = Redis::start_on(port);
    // B's connections learn the new Redis (and its new `run_id`) on this probe's calls.
    wait_answering(&b).await;
    let sent = Instant::now();
    let r = c
        .post(b.url("/reports/generate"))
        .header("X-API-Key", "b0")
        .send()
        .await
        .unwrap();
    let took = sent.elapsed();
    assert_eq!(r.status(), 503);
    assert!(
        took < Duration::from_millis(3200),
        "refused after {took:?}, its queue_timeout is 2 s"
    );
    assert_eq!(up.count("/reports/generate"), 2);
    for t in first {
        assert_eq!(t.await.unwrap(), 200);
    }
}

/// A plan's `max_in_flight_per_key` after Redis restarted empty: A runs key `gold`'s 3 (its
/// plan's cap) when Redis restarts; B's worker threads still hold connections to the old
/// process, so B's requests for `gold`, sent as soon as Redis listens, find them closed and
/// are charged again on new ones, which read the new `run_id` only then. Each must be decided
/// beside A's 3 leases, registered again: 429 `concurrency-limit`, never a 4th at the
/// upstream. (Before, the key's slot was taken at once: the cap's half of the race that
/// `a_request_that_meets_the_restart_on_its_charge_holds_back_too` shows on a route.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_cap_holds_when_its_charge_meets_the_restart() {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::ZERO);
    let cfg = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: deny\n  fleet_size: 2\n  lease_ttl: 15s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\nplans:\n  gold: {{max_cost: {MAX}, window: 8760h, max_in_flight_per_key: 3}}\n  basic: {{max_cost: {MAX}, window: 8760h}}\nkeys:\n  - {{id: g, sha256: \"{}\", plan: gold}}\n  - {{id: w, sha256: \"{}\", plan: basic}}\n",
        redis.url(),
        sha256_hex("gold"),
        sha256_hex("warm"),
    );
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg);
    let c = client();
    // B's worker threads know the Redis process before it goes.
    for _ in 0..4 {
        assert_eq!(get(&c, b.url("/warm"), "warm").await.status(), 200);
    }
    let first: Vec<_> = (0..3)
        .map(|_| spawn_get(&c, a.url("/items?delay_ms=5000"), "gold"))
        .collect();
    up.wait_current("/items", 3).await;
    redis.kill();
    let _redis = Redis::start_on(port);
    let second: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (c.clone(), b.url("/items?delay_ms=100"));
            tokio::spawn(async move {
                loop {
                    let r = get(&c, url.clone(), "gold").await;
                    let s = r.status().as_u16();
                    let body = r.text().await.unwrap();
                    // A connection that broke with the old Redis, found before the charge:
                    // store-unavailable (deny), never admitted. Sent again.
                    if s == 503 && body.contains("store-unavailable") {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    return (s, body);
                }
            })
        })
        .collect();
    for t in second {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 429, "{body}\n{}", b.log());
        assert!(body.contains("concurrency-limit"), "{body}");
    }
    for t in first {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(up.count("/items"), 3);
    assert_eq!(up.max_concurrent("/items"), 3);
}

/// A worker's connection that the server closed (Redis restarted) before the once-a-second
/// watch noticed: the admission that finds it dead is sent again on a new connection (an
/// admission is decided once by its id, however often sent) instead of failing: the next
/// request after the restart is decided by the new Redis, not refused by `on_error: deny`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_on_a_connection_the_server_closed_is_sent_again() {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &store_yaml(&redis.url(), "").replace("on_error: local", "on_error: deny"),
        threads: 1,
        ..GatewayOpts::default()
    });
    let c = client();
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 200);
    for round in 0..3 {
        redis.kill();
        redis = Redis::start_on(port);
        let r = get(&c, gw.url("/items"), "k").await;
        assert_eq!(r.status(), 200, "round {round}: {}", gw.log());
        // The new Redis is empty: this is the key's first unit there.
        assert_eq!(
            header(&r, "x-ratelimit-remaining"),
            Some((MAX - 1).to_string()),
            "round {round}"
        );
    }
}

/// Gateway A's path to Redis is blackholed for 5 s while B's stays up, then healed: what A
/// sent meanwhile reaches Redis late, after A gave up on it and decided on its local share.
/// Each late admission is undone by its admission id (or finds the tombstone its undo left
/// first), and A's local admissions are written back: the metered key is charged exactly what
/// the upstream ran for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_that_delivers_late_charges_once() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let via = |url: &str| store_yaml(url, "");
    let a = Gateway::start(&up, &via(&proxy.url()));
    let b = Gateway::start(&up, &via(&redis.url()));
    let gws = Arc::new(vec![a, b]);
    let c = client();
    let load = Load::start(&c, &gws, "m", 4, Duration::from_millis(10), |_| "/items");
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.blackhole();
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_secs(2)).await;
    load.stop().await;
    let fallback = metric(
        &gws[0],
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
    )
    .await;
    assert!(fallback > 0.0, "A decided on its local share meanwhile");
    charged_settles(&c, &gws[1], "m", || up.count("/items")).await;
}

/// Redis closes every gateway connection every 200 ms (`CLIENT KILL TYPE normal`) under
/// load: calls it ran but whose replies it dropped look, to the gateway, like calls that
/// never ran. Each is decided on the local share (and written back) and undone by its
/// admission id; a write-back or charge after the fact that may have run is sent again under
/// its id, charged once. The metered key is charged exactly what the upstream ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_killed_under_load_charge_once() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let cfg = body(
        &redis,
        "  endpoints:\n    /q: {cost: 1, cost_from_response: X-Actual-Cost}\n",
    );
    let gws: Arc<Vec<Gateway>> = Arc::new((0..2).map(|_| Gateway::start(&up, &cfg)).collect());
    let c = client();
    let load = Load::start(&c, &gws, "m", 6, Duration::ZERO, |n| {
        if n % 2 == 0 {
            "/q?actual_cost=3&delay_ms=20"
        } else {
            "/items"
        }
    });
    let mut killed = 0u64;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        killed += redis
            .cli(&["CLIENT", "KILL", "TYPE", "normal"])
            .parse::<u64>()
            .unwrap_or(0);
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    load.stop().await;
    assert!(killed >= 20, "connections killed: {killed}");
    let admitted = |up: &Upstream| 3 * up.count("/q") + up.count("/items");
    charged_settles(&c, &gws[0], "m", || admitted(&up)).await;
}

/// Gateway A, running 3 long reports on a cap of 3 (`lease_ttl` 3 s), is paused for 7 s
/// (SIGSTOP): its leases lapse while its upstream work goes on, and B's 2 waiting reports
/// get their slots (5 at the upstream: the bound while an instance is paused past
/// `lease_ttl`). On SIGCONT, A's renewals re-create its 3 leases, so the route counts 5 of 3
/// again and a further report waits until A's end instead of running beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_instance_gets_its_leases_back_on_resume() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::from_secs(8));
    let cfg = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: deny\n  fleet_size: 2\n  lease_ttl: 3s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: 3, queue_timeout: 30s}}\n",
        redis.url()
    );
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg);
    let c = client();
    let report = |gw: &Gateway, key: String| spawn_post(&c, gw.url("/reports/generate"), &key);
    let mut all: Vec<_> = (0..3).map(|i| report(&a, format!("a{i}"))).collect();
    up.wait_current("/reports/generate", 3).await;
    a.signal("STOP");
    let stopped = Instant::now();
    all.extend((0..2).map(|i| report(&b, format!("b{i}"))));
    // A's leases lapse (3 s) and B's two are granted: 5 at the upstream.
    up.wait_current("/reports/generate", 5).await;
    tokio::time::sleep(Duration::from_secs(7).saturating_sub(stopped.elapsed())).await;
    a.signal("CONT");
    // A's renewals are overdue: they run at once and re-create its leases.
    redis
        .wait_route_slots("/reports/generate", 5, Duration::from_secs(3))
        .await;
    all.push(report(&b, "late".into()));
    for t in all {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(up.count("/reports/generate"), 6);
    assert_eq!(
        up.max_concurrent("/reports/generate"),
        5,
        "the late report waited for A's to end"
    );
}

/// Redis itself stalls (SIGSTOP) for longer than `lease_ttl` while gateway A runs a report on
/// a cap of 1: nobody could renew A's lease, and by Redis's clock it lapsed. B's client asks
/// for a report all along (503 `store-unavailable` while Redis is away, `on_error: deny`).
/// Once Redis answers, B holds its report back while A registers its lease again, and the
/// report waits for A's: never beside it. (Before, B's report took the slot A's lease had
/// lapsed from, and A's renewal then made the lease again: 2 at the upstream on a cap of 1.)
/// A's own way to Redis comes back only after B's does (a proxy holds it: until B says it saw
/// the silence, or a second after Redis resumes), so that B's report always reaches Redis
/// first unless B holds it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_stall_past_lease_ttl_keeps_the_cap() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_secs(10));
    let cfg = |url: &str| {
        format!(
            "store:\n  backend: redis\n  url: \"{url}\"\n  timeout: 200ms\n  on_error: deny\n  fleet_size: 2\n  lease_ttl: 4s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: 1, queue_timeout: 60s}}\n",
        )
    };
    let a = Gateway::start(&up, &cfg(&proxy.url()));
    let b = Gateway::start(&up, &cfg(&redis.url()));
    let c = client();
    let first = spawn_post(&c, a.url("/reports/generate"), "a");
    up.wait_current("/reports/generate", 1).await;
    redis.pause();
    proxy.blackhole();
    let second = spawn_post_until_decided(&c, b.url("/reports/generate?delay_ms=100"), "b");
    // Past the lease's 4 s: it lapsed by Redis's clock.
    tokio::time::sleep(Duration::from_secs(5)).await;
    redis.resume();
    // A's way back: once B has seen Redis answer after the silence (and holds its slot-taking
    // requests back from then), or 1 s after the resume if it never says so. So A has B's
    // whole hold-back to register its lease again, however late B's breaker closes.
    let b_saw_it = b.wait_log("Redis answers again after a silence");
    let _ = tokio::time::timeout(Duration::from_secs(1), b_saw_it).await;
    proxy.heal();
    assert_eq!(first.await.unwrap(), 200, "{}", a.log());
    assert_eq!(second.await.unwrap(), 200, "{}", b.log());
    assert_eq!(up.count("/reports/generate"), 2);
    assert_eq!(
        up.max_concurrent("/reports/generate"),
        1,
        "B's report ran beside A's\n{}\n{}",
        a.log(),
        b.log()
    );
}

/// A capped request's `enter` (its place in the route's queue) reaches Redis only after the
/// gateway gave up on it: it timed out, the request was decided on the local share, and the
/// gateway's `leave` of that id reached Redis first, on a new connection. The late `enter`
/// must take no slot: the leave left the id refused. (Before, it took a slot that nobody held
/// until `lease_ttl`, 15 s here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_enter_delivered_late_takes_no_slot() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: local\n  fleet_size: 1\n  lease_ttl: 15s\nrate_limits:\n  default: {{cost: 1, window: 8760h, max_cost: {MAX}}}\n  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: 2, queue_timeout: 5s}}\n",
        proxy.url()
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(
        post(&c, gw.url("/reports/generate"), "k").await.status(),
        200
    );
    let leases = redis_route_slots_key("/reports/generate");
    let refused = format!("{}x", leases.strip_suffix('f').unwrap());
    wait_idle(&gw, "/reports/generate").await;
    assert_eq!(redis.cli(&["ZCARD", &leases]), "0");

    proxy.hold_matching("\r\nenter\r\n");
    let r = post(&c, gw.url("/reports/generate"), "k").await;
    assert_eq!(r.status(), 200, "decided on the local share");
    assert_eq!(up.count("/reports/generate"), 2);
    // The leave of the id given up on reaches Redis (on another connection) first.
    let start = Instant::now();
    while redis.cli(&["ZCARD", &refused]) != "1" {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no leave reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(proxy.delivered_late(), 0);
    proxy.heal();
    // The held enter arrives now; a slot it took would stay for 15 s.
    let start = Instant::now();
    while proxy.delivered_late() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the enter was not delivered"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        assert_eq!(
            redis.cli(&["ZCARD", &leases]),
            "0",
            "a late enter took a slot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// DESIGN §4: while one instance decides on its local share, the instances on Redis cannot see
/// what it runs (the cap may then run up to cap + its share); once its store answers again, it
/// registers the requests it admitted locally and still runs as leases, before it admits
/// anything new and without waiting for traffic, so that the cap is exact again within 2 s.
/// A's path to Redis is blackholed while it admits 2 long reports on its local share (cap 4,
/// fleet_size 2), then healed; B, on Redis all along, is then sent 4 reports: only 2 run beside
/// A's. (Before, nothing registered them: Redis showed the route empty, its whole cap free for B.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_admissions_are_registered_when_the_store_returns() {
    let a = registered_when_the_store_returns("local", 4, 2, 4).await;
    assert_eq!(
        metric(
            &a,
            "tollgate_fallback_decisions_total{decision=\"admitted\"}"
        )
        .await,
        2.0
    );
}

/// A's path to Redis is down while it admits `on_a` long reports (cap `cap`) by `on_error`;
/// once healed, they are registered as leases within 2 s (DESIGN §4), and B's `from_b`
/// reports, on Redis all along, run only beside them up to the cap (beyond it only what A
/// had admitted past it, as `allow` does). A, for more checks.
async fn registered_when_the_store_returns(
    on_error: &str,
    cap: usize,
    on_a: usize,
    from_b: usize,
) -> Gateway {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let body = |url: &str| {
        store_yaml(
            url,
            &format!("  endpoints:\n    /reports/generate: {{cost: 1, max_in_flight: {cap}, queue_timeout: 20s}}\n"),
        )
        .replace("on_error: local", &format!("on_error: {on_error}"))
    };
    let a = Gateway::start(&up, &body(&proxy.url()));
    let b = Gateway::start(&up, &body(&redis.url()));
    let c = client();
    proxy.blackhole();
    let admitted_on_a: Vec<_> = (0..on_a)
        .map(|_| spawn_post(&c, a.url("/reports/generate?delay_ms=4000"), "k"))
        .collect();
    up.wait_current("/reports/generate", on_a as u64).await;
    let leases = redis_route_slots_key("/reports/generate");
    assert_eq!(redis.cli(&["ZCARD", &leases]), "0");
    proxy.heal();
    registered_within_2s(&redis, &leases, on_a).await;
    let sent_to_b: Vec<_> = (0..from_b)
        .map(|_| spawn_post(&c, b.url("/reports/generate?delay_ms=300"), "j"))
        .collect();
    for s in admitted_on_a.into_iter().chain(sent_to_b) {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(up.max_concurrent("/reports/generate"), cap.max(on_a) as u64);
    assert_eq!(up.count("/reports/generate"), (on_a + from_b) as u64);
    a
}

/// Group commit, a timeout in the middle of a batch (`store::redis::batch`): while Redis is
/// paused, each worker thread's first two `admit` calls are in flight and the others gather
/// behind them; once one is answered they go as one `admit_batch`, which the proxy holds until every request
/// in it gave up (`store.timeout`) and was admitted on the local share. The batch then reaches
/// Redis and charges; each of its admissions is undone by its id, and each local admission is
/// written back once, so every request is charged exactly once: in the end the key has paid
/// for exactly the requests the upstream ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_times_out_charges_each_request_at_most_once() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    // The first calls wait out the pause well within the timeout; the 20 requests arrive
    // during it with half a second to spare, so their batch forms however slow the machine.
    let gw = Gateway::start(
        &up,
        &store_yaml(&proxy.url(), "").replace("200ms", "1200ms"),
    );
    let c = client();
    // Both worker threads connected (and admit_one loaded): requests at once, a few times.
    for _ in 0..4 {
        let warm: Vec<_> = (0..4)
            .map(|_| spawn_get(&c, gw.url("/items"), "warm"))
            .collect();
        for w in warm {
            assert_eq!(w.await.unwrap(), 200);
        }
    }
    let sha = tollgate::store::redis::script_sha("admit_batch").unwrap();
    proxy.hold_matching(&sha);
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]), "OK");
    let sent: Vec<_> = (0..20)
        .map(|_| spawn_get(&c, gw.url("/items"), "k"))
        .collect();
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(up.count("/items"), 36);
    assert_eq!(proxy.delivered_late(), 0);
    proxy.heal();
    // The held batch reaches Redis, charges, and is undone request by request.
    gw.wait_log("a timed-out admission reached Redis after all")
        .await;
    assert!(proxy.delivered_late() > 0);
    // Only what the upstream ran (the probes included) stays charged.
    charged_settles(&c, &gw, "k", || up.count("/items") - 16).await;
}

/// DESIGN §4: "When the store returns, the shared budget is in force again within seconds."
/// Redis restarts while the gateway is idle. Each worker thread's connection to the old
/// process is found dead without a request failing on it: a few seconds later every request
/// is decided in Redis (the full budget, not the local share of a third), none by the
/// fallback. And the degraded state an outage left, with no traffic after it, ends by itself
/// once the store answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_restart_requests_are_decided_in_redis_without_a_failure_first() {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::ZERO);
    let cfg = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 250ms\n  on_error: local\n  fleet_size: 3\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 120}}\n",
        redis.url()
    );
    let gw = Gateway::start(&up, &cfg);
    // Fresh connections, so that both worker threads connect to Redis.
    let each_thread = async |key: &str| {
        let mut limits = vec![];
        for _ in 0..10 {
            let r = get(&client(), gw.url("/items"), key).await;
            assert_eq!(r.status(), 200);
            limits.push(header(&r, "X-RateLimit-Limit").unwrap());
        }
        limits
    };
    assert_eq!(each_thread("before").await, vec!["120"; 10]);
    redis.kill();
    redis = Redis::start_on(port);
    assert_eq!(redis.cli(&["DBSIZE"]), "0");
    // Within seconds: 3 s of nothing, then every request decided in Redis.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(each_thread("after").await, vec!["120"; 10]);
    assert_metric(
        &gw,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
        0.0,
    )
    .await;

    // An outage with a request in it: degraded, on the local share.
    redis.kill();
    let r = get(&client(), gw.url("/items"), "during").await;
    assert_eq!(header(&r, "X-RateLimit-Limit").as_deref(), Some("40"));
    assert_metric(&gw, "tollgate_store_degraded", 1.0).await;
    // Back, and no request: the gauge clears by itself within seconds.
    let _redis = Redis::start_on(port);
    wait_metric(&gw, "tollgate_store_degraded", 0.0, Duration::from_secs(5)).await;
}

/// The `maxmemory-policy` check keeps reading after Redis restarts: a Redis that comes back
/// evicting is reported at the next minute's check (its connection to the old process was
/// not kept failing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_restarts_evicting_is_reported_at_the_next_check() {
    let port = free_port();
    let mut redis = Redis::start_with(port, &["--maxmemory-policy", "noeviction"]);
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &body(&redis, ""));
    assert_eq!(get(&client(), gw.url("/items"), "k").await.status(), 200);
    wait_metric(
        &gw,
        "tollgate_store_eviction_unsafe",
        0.0,
        Duration::from_secs(5),
    )
    .await;
    redis.kill();
    let _redis = Redis::start_with(port, &["--maxmemory-policy", "allkeys-lru"]);
    // Read at start and every minute after: within 60 s and a margin.
    wait_metric(
        &gw,
        "tollgate_store_eviction_unsafe",
        1.0,
        Duration::from_secs(75),
    )
    .await;
}

/// The degraded state follows what Redis does for tollgate, not whether it answers at all:
/// out of memory under `noeviction` (a `PING` would pass, every charging script fails) it stays
/// degraded while no request comes, and ends by itself once Redis takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_memory_redis_keeps_the_gateway_degraded_until_it_takes_writes() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // `deny`: nothing is admitted meanwhile, so nothing is owed and sent again to Redis.
    let cfg = body(&redis, "").replace("on_error: local", "on_error: deny");
    let gw = Gateway::start(&up, &cfg);
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 200);
    assert_eq!(
        redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
        "OK"
    );
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    let r = get(&c, gw.url("/items"), "k2").await;
    assert_eq!(r.status(), 503);
    assert_metric(&gw, "tollgate_store_degraded", 1.0).await;
    // Three probes later, no request since: still degraded.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    assert_metric(&gw, "tollgate_store_degraded", 1.0).await;
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");
    wait_metric(&gw, "tollgate_store_degraded", 0.0, Duration::from_secs(5)).await;
}

/// DESIGN §4, "the cap is exact again within 2 s": a request that queued on A's local share
/// while A's path to Redis was down leaves the local queue when Redis answers again and waits
/// in the fleet's queue instead. Cap 1, fleet_size 2 (A's share: 1 slot). A runs one long report
/// locally and queues a second behind it; the path heals; B, on Redis all along, asks for one
/// report and queues behind A's registered one. When A's first ends, one of the two waiters
/// runs, never both. (Before, A's waiter stayed in the local queue and took the local slot as
/// B's took the freed lease: two reports at once on a cap of 1.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_queued_locally_waits_in_the_fleets_queue_once_the_store_returns() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let body = |url: &str| {
        store_yaml(
            url,
            "  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 1, queue_timeout: 30s}\n",
        )
    };
    let a = Gateway::start(&up, &body(&proxy.url()));
    let b = Gateway::start(&up, &body(&redis.url()));
    let c = client();
    proxy.blackhole();
    let first = spawn_post(&c, a.url("/reports/generate?delay_ms=4000"), "k");
    up.wait_current("/reports/generate", 1).await;
    let queued_on_a = spawn_post(&c, a.url("/reports/generate?delay_ms=300"), "k");
    wait_metric(
        &a,
        "tollgate_queued{route=\"/reports/generate\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    proxy.heal();
    let leases = redis_route_slots_key("/reports/generate");
    registered_within_2s(&redis, &leases, 1).await;
    let from_b = spawn_post(&c, b.url("/reports/generate?delay_ms=300"), "j");
    wait_metric(
        &b,
        "tollgate_queued{route=\"/reports/generate\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    for s in [first, queued_on_a, from_b] {
        assert_eq!(s.await.unwrap(), 200);
    }
    assert_eq!(up.max_concurrent("/reports/generate"), 1);
    assert_eq!(up.count("/reports/generate"), 3);
}

/// DESIGN §4 under `on_error: allow`: what A admitted while its store was away (past the cap:
/// `allow` admits everything) is registered as leases when the store answers again, within 2 s,
/// so that what the fleet admits next counts it. A admits 3 long reports on a cap of 2 while
/// its path to Redis is down; once healed, B's 2 reports wait until A's have ended. (Before,
/// nothing registered them: B's ran at once beside A's 3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allowed_admissions_are_registered_when_the_store_returns() {
    registered_when_the_store_returns("allow", 2, 3, 2).await;
}

/// A gateway config on the Redis at `url` whose `/reports/generate` lets a key run 2 of its
/// 10 slots at once (`max_in_flight_per_key`), its further requests waiting 1 s at most.
fn per_key_share_yaml(url: &str, on_error: &str) -> String {
    store_yaml(
        url,
        "  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 10, max_in_flight_per_key: 2, queue_timeout: 1s}\n",
    )
    .replace("on_error: local", &format!("on_error: {on_error}"))
}

/// A `p1` report to `gw` (`delay_ms` long at the upstream): its status, and whether a 503 was
/// `route-busy`. A 503 `store-unavailable` (a worker thread's connection broke with the old
/// Redis, under `on_error: deny`) is sent again.
async fn p1_report(c: &reqwest::Client, gw: &Gateway, delay_ms: u64) -> (u16, bool) {
    let url = gw.url(&format!("/reports/generate?delay_ms={delay_ms}"));
    loop {
        let r = post(c, url.clone(), "p1").await;
        let s = r.status().as_u16();
        let text = r.text().await.unwrap();
        if s == 503 && text.contains("store-unavailable") {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        return (s, text.contains("route-busy"));
    }
}

/// The `/reports/generate` entry of `gw`'s `/admin/routes`, once the fleet's queue counts
/// `running` requests there, every one of them for one key (DESIGN §8: `keys`).
async fn route_counts_one_key(gw: &Gateway, running: u64) {
    eventually(Duration::from_secs(5), async || {
        let v = admin_json(gw, "/admin/routes").await;
        let route = find_route(&v, "/reports/generate").ok_or_else(|| v.to_string())?;
        let keys = route["keys"].as_array().cloned().unwrap_or_default();
        if route["running"] == running && keys.len() == 1 && keys[0]["running"] == running {
            Ok(())
        } else {
            Err(format!("not {running} running for one key: {route}"))
        }
    })
    .await
}

/// DESIGN §4 and §8: the leases an instance registers again after Redis lost its data count
/// for their key, so the key's share of the route holds across the fleet. Key p1 holds its
/// share of 2 through A; Redis is SIGKILLed and started empty; A registers its 2 leases again.
/// Then a p1 request through A and one through B both wait and leave 503 `route-busy`, as
/// one did before the restart. (Before, the re-registered leases were the route's but no
/// key's: both ran at once, p1 ran 4 on a share of 2, and `/admin/routes` listed no key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_registered_again_after_redis_restarted_empty_keep_the_keys_share() {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::ZERO);
    let cfg = per_key_share_yaml(&redis.url(), "deny");
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg);
    let c = client();
    let held: Vec<_> = (0..2)
        .map(|_| spawn_post(&c, a.url("/reports/generate?delay_ms=8000"), "p1"))
        .collect();
    up.wait_current("/reports/generate", 2).await;
    route_counts_one_key(&b, 2).await;
    // The control: p1 is at its share.
    assert_eq!(p1_report(&c, &b, 300).await, (503, true));
    redis.kill();
    redis = Redis::start_on(port);
    redis
        .wait_route_slots("/reports/generate", 2, Duration::from_secs(5))
        .await;
    let (via_a, via_b) = tokio::join!(p1_report(&c, &a, 300), p1_report(&c, &b, 300));
    assert_eq!(
        (via_a, via_b, up.max_concurrent("/reports/generate")),
        ((503, true), (503, true), 2),
        "p1 ran past its share of 2 after Redis restarted empty"
    );
    route_counts_one_key(&b, 2).await;
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert_eq!(up.count("/reports/generate"), 2);
}

/// DESIGN §4 and §8: a request B admitted on its local share while its path to Redis was down
/// is registered, once the store answers, as a lease of its key, so the key's share holds
/// across the fleet. Then two p1 requests through A: one runs beside B's, the other waits and
/// leaves 503 `route-busy`. (Before, the adopted lease was the route's but no key's: both ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_admissions_registered_when_the_store_returns_keep_the_keys_share() {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let a = Gateway::start(&up, &per_key_share_yaml(&redis.url(), "local"));
    let b = Gateway::start(&up, &per_key_share_yaml(&proxy.url(), "local"));
    let c = client();
    proxy.blackhole();
    let on_b = spawn_post(&c, b.url("/reports/generate?delay_ms=9000"), "p1");
    up.wait_current("/reports/generate", 1).await;
    proxy.heal();
    registered_within_2s(&redis, &redis_route_slots_key("/reports/generate"), 1).await;
    // Long enough that the one that waits is not served within its 1 s.
    let (first, second) = tokio::join!(p1_report(&c, &a, 3000), p1_report(&c, &a, 3000));
    let mut got = [first, second];
    got.sort();
    assert_eq!(
        (got, up.max_concurrent("/reports/generate")),
        ([(200, false), (503, true)], 2),
        "p1 ran past its share of 2 beside B's adopted lease"
    );
    route_counts_one_key(&a, 1).await;
    assert_eq!(on_b.await.unwrap(), 200);
    assert_eq!(
        metric(
            &b,
            "tollgate_fallback_decisions_total{decision=\"admitted\"}"
        )
        .await,
        1.0
    );
}

/// DESIGN §8: a request that leaves the queue unserved is refunded; §4: a refund is sent
/// again, never dropped. Two requests wait in Redis's queue for the one slot when Redis stops
/// answering for 8 s (longer than `lease_ttl`, 5 s): they leave with 503s and their refunds
/// cannot reach Redis. Once it answers, the key has paid for the one request that ran. The
/// refunds were sent again for a lease's time only, then dropped, and one that timed out
/// (it may have run) was not sent again: 10 units more stayed charged in most runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refunds_of_waiters_that_left_during_an_outage_reach_redis_after_it() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 250ms\n  on_error: local\n  fleet_size: 2\n  lease_ttl: 5s\nrate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 100}}\n  endpoints:\n    /slow: {{cost: 5, max_in_flight: 1, queue_timeout: 3s, max_queue: 2}}\nplans:\n  hourly: {{max_cost: 100, window: 1h}}\nkeys:\n{}",
        redis.url(),
        registry_key("kf", ", plan: hourly")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let holder = spawn_post(&c, gw.url("/slow?delay_ms=7000"), "key-kf");
    up.wait_current("/slow", 1).await;
    let mut waiters = vec![];
    for _ in 0..2 {
        waiters.push(spawn_post(&c, gw.url("/slow"), "key-kf"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    redis.pause();
    let during = spawn_post(&c, gw.url("/slow"), "key-kf");
    tokio::time::sleep(Duration::from_secs(8)).await;
    redis.resume();
    for w in waiters {
        assert_eq!(w.await.unwrap(), 503);
    }
    let _ = during.await.unwrap();
    assert_eq!(holder.await.unwrap(), 200);
    // What ran: the holder, and whatever the local share let through during the outage
    // (written back). Everything else was given back.
    let ran = up.count("/slow");
    eventually(Duration::from_secs(10), async || {
        let left = remaining(&gw, "kf").await;
        match left == 100 - 5 * ran {
            true => Ok(()),
            false => Err(format!("{left} left, {ran} ran:\n{}", gw.log())),
        }
    })
    .await;
}

/// DESIGN §4: what is admitted on the fallback is charged in full to the shared budget when
/// the store returns. Three requests of one key wait in Redis's queue behind another key's
/// report when Redis is killed; it comes back empty after they ran on the fallback (charged
/// there, written back). The refunds of their Redis charges, sent again until Redis
/// answers, must not cancel the write-back: those charges went with Redis's data. They did:
/// the key was charged nothing for the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_decided_again_after_redis_restarted_empty_stay_charged() {
    waiters_when_redis_restarts_empty(false).await;
}

/// Mission §4: what is charged is what the upstream runs. As above, but Redis comes back
/// empty at once: the three go back into its queue (or, one whose call failed, to the
/// fallback) and run after the holder. Their charges went with Redis's data; each is made
/// again before it waits again. They ran uncharged (0 of 15 units).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_back_in_a_redis_restarted_empty_are_charged_again() {
    waiters_when_redis_restarts_empty(true).await;
}

/// Three requests of key `kw` (cost 5) wait in Redis's queue behind `kh`'s 3 s report when
/// Redis is killed; it starts again empty `at_once`, or after all four ran. `kw` has paid
/// exactly for its three, whatever the path each took.
async fn waiters_when_redis_restarts_empty(at_once: bool) {
    let port = free_port();
    let mut redis = Redis::start_on(port);
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}  endpoints:\n    /slow: {{cost: 5, max_in_flight: 1, queue_timeout: 20s}}\nkeys:\n{}{}",
        store_yaml(&redis.url(), "").replace("fleet_size: 2", "fleet_size: 1"),
        registry_key("kh", ""),
        registry_key("kw", "")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let holder = spawn_post(&c, gw.url("/slow?delay_ms=3000"), "key-kh");
    up.wait_current("/slow", 1).await;
    let waiters: Vec<_> = (0..3)
        .map(|_| spawn_post(&c, gw.url("/slow"), "key-kw"))
        .collect();
    wait_queued(&gw, "/slow", 3.0).await;
    redis.kill();
    if at_once {
        redis = Redis::start_on(port);
    }
    assert_eq!(holder.await.unwrap(), 200);
    for w in waiters {
        assert_eq!(w.await.unwrap(), 200);
    }
    if !at_once {
        redis = Redis::start_on(port);
    }
    let ran = up
        .api
        .seen()
        .iter()
        .filter(|s| s.header("x-api-key") == ["key-kw"])
        .count() as u64;
    assert_eq!(ran, 3);
    let on_fallback = gw
        .access_log()
        .iter()
        .filter(|l| l["key"] == "kw" && l["fallback"] == true)
        .count();
    if !at_once {
        // They ran on the fallback (what that case is about), not back in a restarted Redis.
        assert_eq!(on_fallback, 3, "{}", gw.log());
    }
    // Charged exactly once the write-back (or the charge made again) has landed, however long
    // that takes on a loaded machine; and still so after every refund sent again has had time
    // to reach Redis (every 2 s at most): a stale refund cancelled the write-back.
    let want = MAX - 5 * ran;
    let settled = async || match remaining(&gw, "kw").await {
        left if left == want => Ok(()),
        left => Err(format!(
            "{left} left for {want}, {on_fallback} on the fallback\n{}",
            gw.log()
        )),
    };
    eventually(Duration::from_secs(15), settled).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let left = remaining(&gw, "kw").await;
    assert_eq!(left, want, "{on_fallback} on the fallback\n{}", gw.log());
    drop(redis);
}

/// An instance that exits owing the shared budget what its fallback admitted writes it back
/// first: SIGTERM during an outage waits, within its grace period, for the store to return
/// (DESIGN §4: over any period that includes an outage a key gets at most its budget plus one
/// burst; an instance that exits in it is no exception). (It exited once idle, a second
/// after SIGTERM, and the units were never charged.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_exits_during_an_outage_writes_back_first() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let cfg = body(&redis, "");
    let mut gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &cfg,
        grace: "10s",
        ..GatewayOpts::default()
    });
    let c = client();
    let r = get(&c, gw.url("/items"), "exiting").await;
    assert_eq!(header(&r, "X-RateLimit-Limit"), Some(MAX.to_string()));
    redis.pause();
    // Until the fallback decides (its share's limit), then five more on it.
    let mut admitted = 1;
    let mut local = 0;
    while local < 5 {
        let r = get(&c, gw.url("/items"), "exiting").await;
        assert_eq!(r.status(), 200);
        admitted += 1;
        if header(&r, "X-RateLimit-Limit") == Some((MAX / 2).to_string()) {
            local += 1;
        }
    }
    gw.signal("TERM");
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.resume();
    assert_eq!(gw.wait_exit(Duration::from_secs(15)), Some(0));
    let log = gw.log();
    assert!(!log.contains("not written back"), "{log}");
    let other = Gateway::start(&up, &cfg);
    assert_eq!(charged(&c, &other, "exiting").await, admitted, "{log}");
}

/// A refusal an instance keeps in memory (its deny cache) is forgotten when another
/// instance writes back what its fallback admitted for the key: the next refusal asks Redis,
/// and its `Retry-After` counts the debt (DESIGN §3: the seconds until the cost fits). (It
/// kept the refusal Redis made before the write-back, and told clients to come back long
/// before their cost could fit, until that moment came.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_refusal_is_forgotten_when_another_instance_writes_back() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // 10 an hour: a unit drains in 360 s.
    let cfg = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: local\n  fleet_size: 2\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 10}}\n",
        redis.url()
    );
    let (a, b) = (Gateway::start(&up, &cfg), Gateway::start(&up, &cfg));
    let c = client();
    for _ in 0..10 {
        assert_eq!(get(&c, a.url("/items"), "owing").await.status(), 200);
    }
    let retry_after =
        |r: &reqwest::Response| -> u64 { header(r, "Retry-After").unwrap().parse().unwrap() };
    let r = get(&c, a.url("/items"), "owing").await;
    assert_eq!(r.status(), 429);
    assert!(retry_after(&r) <= 360, "{:?}", header(&r, "Retry-After"));
    // B admits its share (5) on the fallback while Redis is away, then writes it back.
    redis.pause();
    let mut local = 0;
    loop {
        let r = get(&c, b.url("/items"), "owing").await;
        if r.status() != 200 {
            break;
        }
        local += 1;
    }
    redis.resume();
    assert_eq!(local, 5);
    // Redis has the debt once B's refusal is Redis's and counts it: 15 units, 6 to drain.
    let start = Instant::now();
    loop {
        let r = get(&c, b.url("/items"), "owing").await;
        assert_eq!(r.status(), 429);
        if header(&r, "X-RateLimit-Limit").as_deref() == Some("10") && retry_after(&r) > 2000 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "B never wrote back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = get(&c, a.url("/items"), "owing").await;
    assert_eq!(r.status(), 429);
    assert!(retry_after(&r) > 2000, "{:?}", header(&r, "Retry-After"));
}

/// A stated cost below the admission's, settled on the fallback while the store is away: the
/// key ends charged what the upstream stated, whether the refund finds its write-back still
/// owed (forgiven) or on its way (given back after it: `fallback::tests::
/// a_refund_behind_its_write_back_goes_after_it` makes that case for sure; here it is the
/// sending task's timing). (Refunded once to the unreachable store, it was lost: the key
/// stayed charged the whole admission.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_behind_its_write_back_is_not_lost() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let cfg = body(
        &redis,
        "  endpoints:\n    /q: {cost: 10, cost_from_response: X-Actual-Cost}\n",
    );
    let gw = Gateway::start(&up, &cfg);
    let c = client();
    // Connected: the write-back goes out (and times out, so it may have run) while the
    // store is away, rather than failing to connect.
    for _ in 0..4 {
        assert_eq!(get(&c, gw.url("/items"), "stated").await.status(), 200);
    }
    redis.pause();
    // Admitted on the fallback; its write-back is tried (and times out) while it runs.
    let r = get(&c, gw.url("/q?actual_cost=0&delay_ms=2000"), "stated").await;
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.resume();
    // Each reading's probe is charged 1, seen by the next reading; the 4 before, and 0 for
    // the request.
    let start = Instant::now();
    let mut probes = 4;
    loop {
        let got = charged(&c, &gw, "stated").await;
        if got == probes {
            break;
        }
        probes += 1;
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "charged {got} for {} requests to /items\n{}",
            probes - 1,
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `on_error: deny`: requests queued for a capped route's slot ride out a Redis stall of a few
/// seconds. Their places (and charges) are in Redis, which keeps them; they run as slots free
/// once it answers again, never over the cap. Before, a waiter was sent back to enter the
/// queue again as soon as two of its instance's beats failed, and entering through a store
/// that did not answer refused it 503 `store-unavailable` (2 of 2 runs with a 2.5 s stall).
/// 3 s: past the 2 s after which Redis drops a silent instance's waiters as dead, so their
/// instances take them back (in their places) once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_under_deny_ride_out_a_short_redis_stall() {
    let q = queued_through(Outage::Stall, Duration::from_secs(3), "30s").await;
    q.all_served();
}

/// [`requests_queued_under_deny_ride_out_a_short_redis_stall`] when only one gateway is cut
/// off from Redis (a proxy holds its way there for 3 s), while the other beats on: Redis drops
/// the cut-off gateway's waiter as dead, and takes it back in its place when it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_under_deny_rides_out_its_gateways_cut_from_redis() {
    let q = queued_through(Outage::CutOffB, Duration::from_secs(3), "30s").await;
    q.all_served();
}

/// Past 5 s of a store that does not answer, `deny` answers the waiters (503
/// `store-unavailable`, while Redis is still away) instead of keeping them for their
/// `queue_timeout` (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_under_deny_are_refused_once_a_stall_outlasts_five_seconds() {
    let q = queued_through(Outage::Stall, Duration::from_secs(8), "30s").await;
    q.waiters_refused_unavailable(Duration::from_secs(4)..Duration::from_secs(8));
}

/// A waiter whose `queue_timeout` (2 s) ends while the store does not answer is answered for
/// the store (503 `store-unavailable`, as `deny` says), not for a full route (`route-busy`):
/// nobody knows whether the route is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_timeout_during_a_stall_under_deny_is_the_stores_failure() {
    let q = queued_through(Outage::Stall, Duration::from_secs(4), "2s").await;
    q.waiters_refused_unavailable(Duration::ZERO..Duration::from_secs(4));
}

/// What [`queued_through`] cuts off.
enum Outage {
    /// Redis itself (SIGSTOP).
    Stall,
    /// Gateway B's way to Redis (a proxy holds it, then delivers it late).
    CutOffB,
}

/// What [`queued_through`] saw.
struct QueuedThrough {
    up: Upstream,
    a: Gateway,
    b: Gateway,
    /// The holder's answer, then a waiter's on each gateway: each with when it came, from
    /// the outage's start.
    answers: Vec<(Answer, Duration)>,
}

impl QueuedThrough {
    /// Every request ran, one at a time.
    fn all_served(&self) {
        for (answer, _) in &self.answers {
            assert_eq!(
                answer.as_ref().map(|a| a.0),
                Ok(200),
                "{answer:?}\n{}\n{}",
                self.a.log(),
                self.b.log()
            );
        }
        assert_eq!(self.up.count("/reports/generate"), 3);
        assert_eq!(self.up.max_concurrent("/reports/generate"), 1);
    }

    /// Both waiters got 503 `store-unavailable`, `within` the outage's start.
    fn waiters_refused_unavailable(&self, within: std::ops::Range<Duration>) {
        for (answer, at) in &self.answers[1..] {
            let (status, _, body) = answer.as_ref().expect("answered");
            assert_eq!(*status, 503, "{body}");
            assert!(body.contains("store-unavailable"), "{body}");
            assert!(
                within.contains(at),
                "answered {at:?} after the outage began"
            );
        }
    }
}

/// Two gateways (`on_error: deny`; B on Redis through a proxy), a cap of 1 held by a 3 s
/// report on A, one report queued on each gateway behind it (for `queue_timeout`); then the
/// outage, for `lasting`.
async fn queued_through(outage: Outage, lasting: Duration, queue_timeout: &str) -> QueuedThrough {
    let redis = Redis::start();
    let proxy = Proxy::start(redis.port);
    let up = Upstream::start(Duration::from_secs(3));
    let cfg = reports_on_deny(&redis, 1, queue_timeout);
    let a = Gateway::start(&up, &cfg);
    let b = Gateway::start(&up, &cfg.replace(&redis.url(), &proxy.url()));
    let c = client();
    let holder = spawn_post_answer(&c, a.url("/reports/generate"), "k0");
    up.wait_current("/reports/generate", 1).await;
    let waiters = [(&a, "k1"), (&b, "k2")]
        .map(|(gw, key)| spawn_post_answer(&c, gw.url("/reports/generate"), key));
    let queued = r#"tollgate_queued{route="/reports/generate"}"#;
    for gw in [&a, &b] {
        wait_metric(gw, queued, 1.0, Duration::from_secs(5)).await;
    }
    let began = Instant::now();
    match outage {
        Outage::Stall => redis.pause(),
        Outage::CutOffB => proxy.blackhole(),
    }
    let end = async {
        tokio::time::sleep(lasting).await;
        match outage {
            Outage::Stall => redis.resume(),
            Outage::CutOffB => proxy.heal(),
        }
    };
    let answered = async {
        let mut answers = vec![];
        for t in std::iter::once(holder).chain(waiters) {
            let answer = t.await.unwrap();
            answers.push((answer, began.elapsed()));
        }
        answers
    };
    let ((), answers) = tokio::join!(end, answered);
    QueuedThrough { up, a, b, answers }
}
