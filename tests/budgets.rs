//! Several budgets per request (DESIGN §1, §3): plans with a minute and a day budget, charged
//! all or nothing, against the real gateway on both stores.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// The store section for `redis`, or nothing for the memory store.
fn store(redis: Option<&Redis>) -> String {
    match redis {
        Some(r) => format!(
            "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n  on_error: deny\n",
            r.url()
        ),
        None => String::new(),
    }
}

fn minute_and_day(redis: Option<&Redis>) -> String {
    format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 120}}\n  endpoints:\n    /reports/generate: {{cost: 20}}\nplans:\n  pro:\n    budgets:\n      - {{ name: minute, max_cost: 50, window: 60s }}\n      - {{ name: day, max_cost: 30, window: 24h }}\nkeys:\n  - {{ id: acme, sha256: \"{}\", plan: pro }}\n",
        store(redis),
        sha256_hex("acme-key")
    )
}

async fn the_day_budget_refuses_and_charges_neither(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &minute_and_day(redis));
    let c = client();

    let r = post(&c, gw.url("/reports/generate"), "acme-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "RateLimit-Policy").unwrap(),
        "\"pro-minute\";q=50;w=60, \"pro-day\";q=30;w=86400"
    );
    let rl = header(&r, "RateLimit").unwrap();
    assert!(
        rl.starts_with("\"pro-minute\";r=30;t=") && rl.contains(", \"pro-day\";r=10;t="),
        "{rl}"
    );
    // The tightest budget: the day one, 10 left.
    assert_eq!(header(&r, "X-RateLimit-Limit").unwrap(), "30");
    assert_eq!(header(&r, "X-RateLimit-Remaining").unwrap(), "10");

    // The minute budget has room for another report, the day budget has not.
    let r = post(&c, gw.url("/reports/generate"), "acme-key").await;
    assert_eq!(r.status(), 429);
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    // 10 more units of a 30-per-day budget: 8 hours.
    assert!(
        (7 * 3600..=8 * 3600).contains(&retry),
        "Retry-After {retry}"
    );
    let rl = header(&r, "RateLimit").unwrap();
    assert!(
        rl.starts_with("\"pro-minute\";r=30;") && rl.contains("\"pro-day\";r=10;"),
        "nothing was charged: {rl}"
    );
    assert_eq!(header(&r, "X-RateLimit-Limit").unwrap(), "30");
    assert_eq!(header(&r, "X-RateLimit-Cost").unwrap(), "0");
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["type"].as_str().unwrap().ends_with("quota-exceeded"));

    // The refusal charged neither: a cheap request sees both budgets as they were, less 1.
    let r = get(&c, gw.url("/items"), "acme-key").await;
    assert_eq!(r.status(), 200);
    let rl = header(&r, "RateLimit").unwrap();
    assert!(
        rl.starts_with("\"pro-minute\";r=29;") && rl.contains("\"pro-day\";r=9;"),
        "{rl}"
    );
    assert_eq!(up.count("/reports/generate"), 1);

    // The admin view shows both budgets, and at the top the one the key is short of. (The
    // minute budget gets a unit back every 1.2 s: 29 left, or 30 on a slow machine.)
    let v = admin_json(&gw, "/admin/keys/acme").await;
    assert_eq!(v["plan"], "pro");
    // The id percent-encoded is the same id (it was a 404).
    let encoded = admin_json(&gw, "/admin/keys/%61cme").await;
    assert_eq!(encoded["plan"], "pro", "{encoded}");
    let b = &v["budgets"];
    assert_eq!(b.as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(
        (&b[0]["name"], &b[0]["limit"], &b[0]["window_seconds"]),
        (&"pro-minute".into(), &50.into(), &60.0.into()),
        "{v}"
    );
    assert!(matches!(b[0]["remaining"].as_u64(), Some(29 | 30)), "{v}");
    assert_eq!(
        (
            &b[1]["name"],
            &b[1]["limit"],
            &b[1]["window_seconds"],
            &b[1]["remaining"]
        ),
        (&"pro-day".into(), &30.into(), &86400.0.into(), &9.into()),
        "{v}"
    );
    assert_eq!(
        (&v["budget"], &v["limit"], &v["remaining"]),
        (&"pro-day".into(), &30.into(), &9.into()),
        "{v}"
    );
    assert_eq!(
        (&v["window_seconds"], &v["reset_seconds"]),
        (&b[1]["window_seconds"], &b[1]["reset_seconds"]),
        "{v}"
    );

    if let Some(redis) = redis {
        // Both budgets live under the key's hash tag (one Cluster slot, one script call).
        let keys = redis.cli(&["KEYS", "t{*"]);
        // Budgets only: beside them are the records of admission ids (`t{…}a…`).
        let mut keys: Vec<&str> = keys.lines().filter(|k| !k.contains("}a")).collect();
        keys.sort();
        assert_eq!(keys.len(), 2, "{keys:?}");
        assert!(
            keys[1].ends_with("}b:day") && keys[1].starts_with(keys[0]),
            "{keys:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minute_and_day_budgets_on_memory() {
    the_day_budget_refuses_and_charges_neither(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minute_and_day_budgets_on_redis() {
    let redis = Redis::start();
    the_day_budget_refuses_and_charges_neither(Some(&redis)).await;
}

#[test]
fn check_and_explain_show_every_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(
        &path,
        format!(
            "upstream: {{url: \"http://127.0.0.1:1\"}}\n{}",
            minute_and_day(None)
        ),
    )
    .unwrap();
    let run = |args: &[&str]| cli_ok(&path, args);
    let check = run(&["check"]);
    assert!(
        check.contains("pro-minute") && check.contains("pro-day"),
        "{check}"
    );
    let explain = run(&["explain", "POST", "/reports/generate", "--key", "acme-key"]);
    assert!(
        explain.contains("\"pro-minute\" 50 units per 1m")
            && explain.contains("\"pro-day\" 30 units per 24h"),
        "{explain}"
    );
}

/// A store section for a fleet on `redis`.
fn fleet_store(redis: &Redis, fleet_size: u32) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 500ms\n  on_error: local\n  fleet_size: {fleet_size}\n",
        redis.url()
    )
}

/// The incident through tollgate: six workers, one per gateway process, each with its own
/// key, call a provider whose cap is one call per 500 ms. The shared budget holds them in line
/// (`max_delay`), so every call succeeds and the provider sees them spaced, fleet-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn six_workers_share_one_provider_cap() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/provider/{{*rest}}\":\n      shared: {{max_cost: 1, window: 500ms, max_delay: 30s}}\n",
        fleet_store(&redis, 6)
    );
    let gws: Vec<Gateway> = (0..6).map(|_| Gateway::start(&up, &body)).collect();
    let c = client();
    let workers = gws.iter().enumerate().map(|(w, gw)| {
        let c = c.clone();
        let url = gw.url("/provider/jobs");
        async move {
            let mut statuses = vec![];
            for _ in 0..5 {
                let r = get(&c, url.clone(), &format!("worker-{w}")).await;
                statuses.push(r.status().as_u16());
            }
            statuses
        }
    });
    let statuses: Vec<u16> = futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(statuses, vec![200; 30], "every call waited its turn");

    let arrivals = up.arrivals("/provider/");
    assert_eq!(arrivals.len(), 30);
    // One call per 500 ms across the fleet; a little slack for a loaded machine's wake-ups.
    let gaps: Vec<u128> = arrivals
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    for w in arrivals.windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap >= Duration::from_millis(350),
            "calls {gap:?} apart: {gaps:?}"
        );
    }
    for w in arrivals.windows(3) {
        let span = w[2] - w[0];
        assert!(
            span >= Duration::from_millis(850),
            "three calls within {span:?}: more than 2 in a second"
        );
    }
    // Each key was charged its own 5 calls, nothing more (its budget refills ~1 unit per 15 min).
    for (w, gw) in gws.iter().enumerate() {
        let r = get(&c, gw.url("/items"), &format!("worker-{w}")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "X-RateLimit-Remaining").unwrap(), "94");
    }
}

/// A shared budget with `max_delay` across a Redis outage (`on_error: local`, two gateways):
/// the calls Redis already scheduled (held for their turn) go out on its schedule, and the
/// local shares do not schedule beside them as if nothing were pending. Over any 10 s the
/// provider sees at most what the budget allows (2 + 2 × 10) plus one extra burst of the
/// local shares (2), and a little for the wake-ups of a loaded machine: 26. Before, the local
/// shares started empty and scheduled 10 s of calls each next to Redis's: ~40.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_budgets_schedule_holds_across_an_outage() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100000}}\n  endpoints:\n    \"/p/{{*rest}}\":\n      shared: {{max_cost: 2, window: 1s, max_delay: 10s}}\n",
        fleet_store(&redis, 2).replace("timeout: 500ms", "timeout: 200ms")
    );
    let gws: Vec<Gateway> = (0..2).map(|_| Gateway::start(&up, &body)).collect();
    let c = client();
    let start = std::time::Instant::now();
    let stop_at = start + Duration::from_secs(16);
    let mut workers = vec![];
    for (g, gw) in gws.iter().enumerate() {
        for w in 0..8 {
            let (c, url, key) = (c.clone(), gw.url("/p/call"), format!("w-{g}-{w}"));
            workers.push(tokio::spawn(async move {
                let mut statuses = vec![];
                while std::time::Instant::now() < stop_at {
                    let s = get(&c, url.clone(), &key).await.status().as_u16();
                    statuses.push(s);
                    if s != 200 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                statuses
            }));
        }
    }
    // Redis schedules the callers 10 s ahead; then it is gone.
    tokio::time::sleep(Duration::from_secs(4)).await;
    redis.kill();
    let mut statuses = vec![];
    for w in workers {
        statuses.extend(w.await.unwrap());
    }
    assert!(
        statuses.iter().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
    let arrivals = up.arrivals("/p/");
    let most = arrivals
        .iter()
        .enumerate()
        .map(|(i, t)| {
            arrivals[i..]
                .iter()
                .take_while(|u| **u - *t <= Duration::from_secs(10))
                .count()
        })
        .max()
        .unwrap_or(0);
    let spread: Vec<u128> = arrivals
        .iter()
        .map(|t| (*t - start).as_millis() / 1000)
        .collect();
    assert!(
        most <= 26,
        "{most} calls within 10 s; arrivals by second since start: {spread:?}"
    );
    // The budget was used: Redis's schedule and the local shares' after it.
    assert!(arrivals.len() >= 30, "{} calls: {spread:?}", arrivals.len());
}

fn two_providers(store: &str) -> String {
    format!(
        "{store}rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n  endpoints:\n    \"/slow/{{*rest}}\":\n      shared: {{max_cost: 1, window: 60s}}\n    \"/fast/{{*rest}}\":\n      shared: {{max_cost: 5, window: 60s}}\n"
    )
}

/// Two providers with their own caps: refusals of one leave the other alone, carry
/// `reason="shared_budget"`, and charge the caller's own budget nothing. Nothing refills
/// during the test (a unit every 12 s at the fastest): its figures do not depend on how long
/// its requests take.
async fn providers_do_not_interfere(gws: &[Gateway]) {
    let c = client();
    let gw = |i: usize| &gws[i % gws.len()];
    let mut slow = vec![];
    for i in 0..3 {
        slow.push(get(&c, gw(i).url("/slow/x"), "one-key").await);
    }
    let statuses: Vec<u16> = slow.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses, [200, 429, 429]);
    let refused = &slow[1];
    assert!(header(refused, "Retry-After").is_some());
    let policy = header(refused, "RateLimit-Policy").unwrap();
    assert_eq!(policy, "\"default\";q=100;w=3600, \"shared\";q=1;w=60");
    let rl = header(refused, "RateLimit").unwrap();
    assert!(
        rl.starts_with("\"default\";r=99;"),
        "the key was not charged: {rl}"
    );
    assert_eq!(header(refused, "X-RateLimit-Limit").unwrap(), "1");
    for i in 0..5 {
        let r = get(&c, gw(i).url("/fast/x"), "one-key").await;
        assert_eq!(r.status(), 200, "the fast provider's cap is its own");
    }
    let r = get(&c, gw(0).url("/fast/x"), "one-key").await;
    assert_eq!(r.status(), 429);
    // Charged: 1 slow + 5 fast calls, none of the refused ones.
    let r = get(&c, gw(1).url("/items"), "one-key").await;
    assert_eq!(header(&r, "X-RateLimit-Remaining").unwrap(), "93");
    let mut shared_refusals = 0.0;
    for g in gws {
        shared_refusals += metric(
            g,
            "tollgate_rejections_total{reason=\"shared_budget\",route=\"/slow/{*rest}\"}",
        )
        .await
        .max(0.0);
    }
    assert_eq!(shared_refusals, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_providers_on_memory() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &two_providers(""));
    providers_do_not_interfere(&[gw]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_providers_on_redis() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = two_providers(&fleet_store(&redis, 2));
    let gws = [Gateway::start(&up, &body), Gateway::start(&up, &body)];
    providers_do_not_interfere(&gws).await;
}

/// A port with nothing listening.
fn dead_url() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

/// A pool of two live addresses takes turns (DESIGN §1: "round robin over healthy
/// addresses"): ten requests, five to each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_sends_its_requests_round_robin() {
    let (one, two) = (
        Upstream::start(Duration::ZERO),
        Upstream::start(Duration::ZERO),
    );
    let body = format!(
        "upstreams:\n  pool:\n    urls: [\"{}\", \"{}\"]\nrate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/svc/{{*rest}}\": {{upstream: pool, strip_prefix: /svc}}\n",
        one.url(),
        two.url()
    );
    let gw = Gateway::start(&one, &body);
    let c = client();
    for i in 0..10 {
        let r = get(&c, gw.url(&format!("/svc/items?n={i}")), "pool-key").await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!((one.count("/items"), two.count("/items")), (5, 5));
}

async fn pools_skip_dead_addresses(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "upstreams:\n  pool:\n    urls: [\"{}\", \"{}\"]\n    health_check: {{ path: /healthz, interval: 200ms }}\n  dead:\n    urls: [\"{}\", \"{}\"]\n    connect_timeout: 200ms\n{}rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/svc/{{*rest}}\": {{upstream: pool, strip_prefix: /svc}}\n    \"/gone/{{*rest}}\": {{upstream: dead}}\n",
        dead_url(),
        up.url(),
        dead_url(),
        dead_url(),
        store(redis)
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    // The health check runs every 200 ms: wait until it has seen the live address.
    let start = std::time::Instant::now();
    while up.count("/healthz") == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no health check");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..10 {
        let r = get(&c, gw.url("/svc/items?x=1"), "pool-key").await;
        assert_eq!(r.status(), 200, "the dead address is skipped");
    }
    let items: Vec<String> = up
        .api
        .seen()
        .iter()
        .filter(|s| !s.target.starts_with("/healthz"))
        .map(|s| s.target.clone())
        .collect();
    assert_eq!(
        items,
        vec!["/items?x=1"; 10],
        "forwarded without the prefix"
    );
    // The route matched ignoring case and matrix parameters; the prefix goes just the same.
    for target in ["/SVC/items?x=2", "/svc;v=1/items?x=3"] {
        let r = get(&c, gw.url(target), "pool-key").await;
        assert_eq!(r.status(), 200, "{target}");
    }
    let last: Vec<String> = up
        .api
        .seen()
        .iter()
        .rev()
        .filter(|s| !s.target.starts_with("/healthz"))
        .take(2)
        .map(|s| s.target.clone())
        .collect();
    assert_eq!(last, ["/items?x=3", "/items?x=2"]);

    // A pool with no live address: 502, and the charge is given back.
    let r = get(&c, gw.url("/gone/x"), "pool-key").await;
    assert_eq!(r.status(), 502);
    let r = get(&c, gw.url("/svc/items"), "pool-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "X-RateLimit-Remaining").unwrap(),
        "87",
        "12 + this one charged; the 502 refunded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_pool_on_memory() {
    pools_skip_dead_addresses(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_pool_on_redis() {
    let redis = Redis::start();
    pools_skip_dead_addresses(Some(&redis)).await;
}

#[test]
fn check_and_explain_show_the_shared_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(
        &path,
        "upstream: {url: \"http://127.0.0.1:1\"}\nupstreams:\n  gh: {url: \"http://127.0.0.1:2\"}\nrate_limits:\n  default: {window: 60s, max_cost: 120}\n  endpoints:\n    \"/gh/{*rest}\": {upstream: gh, strip_prefix: /gh, shared: {max_cost: 2, window: 1s, max_delay: 30s}}\n",
    )
    .unwrap();
    let run = |args: &[&str]| cli_ok(&path, args);
    let check = run(&["check"]);
    assert!(
        check.contains("2 per 1s") && check.contains("gh"),
        "{check}"
    );
    let explain = run(&["explain", "GET", "/gh/v1/jobs", "--key", "k"]);
    assert!(
        explain.contains("and shared:   \"shared\" 2 units per 1s")
            && explain.contains("upstream:     gh (without the prefix /gh)"),
        "{explain}"
    );
}

/// A reload that changes a budget carries what each key has spent into the new one (§4: a
/// burst never exceeds `max_cost`). A key that spent 10 of 10 an hour has spent 10 of 10 a
/// day when the window grows (it got 9 more when the stored level kept its time until empty:
/// an hour's worth of a day's drain), and exactly 10 more when `max_cost` doubles; a plan's
/// second budget (by name) the same.
async fn a_reloaded_budget_carries_the_units_spent(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 10}}\nplans:\n  pro:\n    budgets:\n      - {{ name: hour, max_cost: 1000, window: 1h }}\n      - {{ name: cap, max_cost: 10, window: 1h }}\nkeys:\n  - {{ id: acme, sha256: \"{}\", plan: pro }}\n  - {{ id: basic, sha256: \"{}\" }}\n",
        store(redis),
        sha256_hex("acme-key"),
        sha256_hex("k")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let admitted = |key: &'static str| {
        let (c, gw) = (&c, &gw);
        async move {
            let mut n = 0;
            loop {
                let r = get(c, gw.url("/items"), key).await;
                match r.status().as_u16() {
                    200 => n += 1,
                    429 => return (n, r),
                    s => panic!("status {s}"),
                }
                assert!(n <= 30, "{key}: no refusal");
            }
        }
    };
    for key in ["k", "acme-key"] {
        assert_eq!(admitted(key).await.0, 10, "{key}");
    }

    gw.edit_config("window: 1h, max_cost: 10}", "window: 24h, max_cost: 10}");
    gw.edit_config(
        "name: cap, max_cost: 10, window: 1h",
        "name: cap, max_cost: 10, window: 24h",
    );
    gw.reload(0.0).await;
    for key in ["k", "acme-key"] {
        let (n, r) = admitted(key).await;
        assert_eq!(n, 0, "{key}: admitted after the window grew");
        // One unit of 10 a day drains in 2.4 hours.
        let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
        assert!((8639..=8640).contains(&retry), "{key}: Retry-After {retry}");
    }

    gw.edit_config("window: 24h, max_cost: 10}", "window: 24h, max_cost: 20}");
    gw.edit_config(
        "name: cap, max_cost: 10, window: 24h",
        "name: cap, max_cost: 20, window: 24h",
    );
    gw.reload(1.0).await;
    for key in ["k", "acme-key"] {
        assert_eq!(admitted(key).await.0, 10, "{key}: after max_cost doubled");
    }
    assert_eq!(up.count("/items"), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_budget_carries_the_units_spent_on_memory() {
    a_reloaded_budget_carries_the_units_spent(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_budget_carries_the_units_spent_on_redis() {
    let redis = Redis::start();
    a_reloaded_budget_carries_the_units_spent(Some(&redis)).await;
}

/// A caller held in line by a shared budget that gives up is not forwarded, and neither its
/// key nor the shared budget keeps its charge.
async fn held_callers_that_leave(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/p/{{*rest}}\":\n      shared: {{max_cost: 1, window: 2s, max_delay: 30s}}\n",
        store(redis)
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(get(&c, gw.url("/p/a"), "k").await.status(), 200);
    // Its turn is ~2 s away: the client gives up after 300 ms.
    let impatient = impatient(Duration::from_millis(300));
    let r = impatient
        .get(gw.url("/p/b"))
        .header("X-API-Key", "k")
        .send()
        .await;
    assert!(r.is_err(), "held past the client's patience");
    // The shared reservation was given back: the next call's turn is when /p/a's unit has
    // refilled (2 s after it), ~0.7 s from now — not 2 s after that, as it would be behind a
    // reservation that was kept.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = std::time::Instant::now();
    let r = get(&c, gw.url("/p/c"), "k").await;
    assert_eq!(r.status(), 200);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    // Past the time the held caller would have gone: it never was.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let forwarded: Vec<String> = up.api.seen().iter().map(|s| s.target.clone()).collect();
    assert_eq!(
        forwarded,
        ["/p/a", "/p/c"],
        "the caller that left was never forwarded"
    );
    // The key paid for /p/a and /p/c only.
    let rl = header(&r, "RateLimit").unwrap();
    assert!(rl.starts_with("\"default\";r=98;"), "{rl}");
    // Its line says how long it was held: until it left (it said the ~2 s planned).
    let gone = gw.wait_access(1, |l| l["decision"] == "client_gone").await;
    let (latency, hold) = (
        gone[0]["latency_ms"].as_f64().unwrap(),
        gone[0]["hold_ms"].as_f64().unwrap(),
    );
    assert!(hold > 0.0 && hold <= latency, "{}", gone[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_callers_that_leave_on_memory() {
    held_callers_that_leave(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_callers_that_leave_on_redis() {
    let redis = Redis::start();
    held_callers_that_leave(Some(&redis)).await;
}

/// A refusal repeated while the budget refills tells how much is left now, on both stores.
/// On Redis the repeat comes from the instance's memory of the refusal (no round trip), which
/// said `r=0` until it lapsed — with a `t` that had moved on: 2.5 units drained, none shown.
async fn a_repeated_refusal_shows_what_has_drained_since(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    // Half a unit a second: 4.1 s after the budget ran out, 2 units are back (never 3 before
    // 6 s), and a cost of 4 still does not fit.
    let gw = Gateway::start(
        &up,
        &format!(
            "{}rate_limits:\n  default: {{cost: 1, window: 10s, max_cost: 5}}\n  endpoints:\n    /four: {{cost: 4}}\n",
            store(redis)
        ),
    );
    let c = client();
    // Half a unit drains each second from the first charge on: what is left when the second
    // /four is decided lies between what drained from the last charge's answer to its sending
    // and from before the first charge to its answer (whatever the machine's pace).
    let before = std::time::Instant::now();
    for _ in 0..5 {
        assert_eq!(get(&c, gw.url("/items"), "drain-key").await.status(), 200);
    }
    let spent = std::time::Instant::now();
    let r = get(&c, gw.url("/four"), "drain-key").await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("0"));
    tokio::time::sleep(Duration::from_millis(4_100)).await;
    let asked = spent.elapsed();
    let r = get(&c, gw.url("/four"), "drain-key").await;
    let most = (before.elapsed().as_secs_f64() / 2.0).floor() as u64;
    let least = (asked.as_secs_f64() / 2.0).floor() as u64;
    if most >= 4 {
        // A runner stalled for seconds: 4 units may be back and the request admitted.
        return;
    }
    assert_eq!(r.status(), 429);
    let left: u64 = header(&r, "x-ratelimit-remaining")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (least..=most).contains(&left),
        "{left} not in {least}..={most}"
    );
    let rl = header(&r, "ratelimit").unwrap();
    assert!(rl.contains(&format!(";r={left};")), "{rl}");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["remaining"], left, "{body}");
    assert_eq!(up.count("/four"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_refusal_shows_what_has_drained_on_memory() {
    a_repeated_refusal_shows_what_has_drained_since(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_refusal_shows_what_has_drained_on_redis() {
    let redis = Redis::start();
    a_repeated_refusal_shows_what_has_drained_since(Some(&redis)).await;
}

/// Held requests are bounded per instance (DESIGN §1: "beyond the bound: 429 with
/// Retry-After"): with 1,024 requests held for their `max_delay` turns, the next one is
/// refused at once, 429 `quota-exceeded` with the Retry-After of the turn it would have had,
/// and nothing is charged for it; once the held callers leave, their reservations come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_requests_are_bounded_per_instance() {
    use std::io::Write;
    const HELD: usize = 1024;
    // Two sockets per held request (ours and the gateway's): the soft limit raised to the
    // hard one, inherited by the gateway, so the test does not depend on the machine's.
    raise_open_files_limit((3 * HELD + 200) as u64);
    let up = Upstream::start(Duration::ZERO);
    // One unit every 10 s: the n-th request is held 10 n seconds (up to 11,000 s), so none
    // is let go while the others are still being held, however slow the machine.
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 10s, max_cost: 1, max_delay: 11000s}\n",
    );
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "hk").await.status(), 200);
    let held: Vec<std::net::TcpStream> = (0..HELD)
        .map(|_| {
            let mut s = raw_connect(gw.port);
            s.write_all(b"GET /items HTTP/1.1\r\nHost: t\r\nX-API-Key: hk\r\n\r\n")
                .unwrap();
            s
        })
        .collect();
    eventually(Duration::from_secs(30), async || {
        let n = metric(&gw, "tollgate_in_flight{route=\"default\"}").await;
        (n == HELD as f64).then_some(()).ok_or(format!("{n} held"))
    })
    .await;
    let t = Instant::now();
    let r = get(&c, gw.url("/items"), "hk").await;
    assert_eq!(r.status(), 429);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // Its turn would have been after the 1,024 others': 10,250 s after the first request,
    // less the time since.
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    let turn = 10 * (HELD as u64 + 1);
    assert!((turn - 60..=turn).contains(&retry), "Retry-After {retry}");
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("0"));
    let problem: serde_json::Value = r.json().await.unwrap();
    assert!(problem["type"]
        .as_str()
        .unwrap()
        .ends_with("quota-exceeded"));
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("1024 requests are already waiting their turn here"),
        "{problem}"
    );
    assert_eq!(up.count("/items"), 1);
    // The held callers leave: never forwarded, their reservations given back.
    drop(held);
    eventually(Duration::from_secs(30), async || {
        let n = metric(&gw, "tollgate_in_flight{route=\"default\"}").await;
        (n == 0.0).then_some(()).ok_or(format!("{n} held"))
    })
    .await;
    assert_eq!(up.count("/items"), 1);
}

/// Raises this process's soft limit on open files to at least `want` (up to the hard limit),
/// for the gateways it starts to inherit.
fn raise_open_files_limit(want: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        if l.rlim_cur < want {
            l.rlim_cur = want.min(l.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
        }
    }
    assert!(l.rlim_cur >= want, "open files limited to {}", l.rlim_cur);
}

/// A gateway that exits (SIGTERM) gives back the reservations of the callers it holds for a
/// shared budget's turn past its grace period, and answers them 503 at once (they may go to
/// another instance), instead of keeping them until it ends with them charged: the fleet's
/// schedule — the provider's — then blocked every other caller behind turns never taken, and
/// each key kept its charge (probe: 18 s of an idle provider after a kill during a burst).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exiting_gateway_gives_back_the_turns_it_holds() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/p/{{*rest}}\":\n      shared: {{max_cost: 1, window: 6s, max_delay: 60s}}\n",
        fleet_store(&redis, 2)
    );
    let mut x = Gateway::start_with_grace(&up, &body, "1s");
    let y = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(get(&c, x.url("/p/first"), "kf").await.status(), 200);
    // Three callers held on x, their turns 6, 12 and 18 s away: past the 1 s grace period if
    // they are held within 4 s (else the test says so).
    let held: Vec<_> = (0..3)
        .map(|i| {
            let req = c
                .get(x.url(&format!("/p/held{i}")))
                .header("X-API-Key", "kh");
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                let retry = header(&r, "Retry-After");
                let status = r.status().as_u16();
                (status, retry, r.text().await.unwrap())
            })
        })
        .collect();
    eventually(Duration::from_secs(4), async || {
        let held = metric(&x, "tollgate_in_flight{route=\"/p/{*rest}\"}").await;
        (held == 3.0).then_some(()).ok_or(format!("{held} held"))
    })
    .await;
    let t = Instant::now();
    x.signal("TERM");
    for h in held {
        let (status, retry, body) = h.await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(retry.as_deref(), Some("1"));
        assert!(
            body.contains("route-busy") && body.contains("shutting down"),
            "{body}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(x.wait_exit(Duration::from_secs(10)), Some(0));
    // The schedule is back to the first call's unit alone: another caller, on y, goes when
    // it has drained (within 6 s of it), not behind three more turns (18 s more).
    let r = get(&c, y.url("/p/next"), "kn").await;
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(12), "{:?}", t.elapsed());
    // Nothing of the held callers reached the upstream, nor stayed charged to their key.
    let forwarded: Vec<String> = up.api.seen().iter().map(|s| s.target.clone()).collect();
    assert_eq!(forwarded, ["/p/first", "/p/next"]);
    let r = get(&c, y.url("/q"), "kh").await;
    let rl = header(&r, "RateLimit").unwrap();
    assert!(rl.starts_with("\"default\";r=99;"), "{rl}");
}

/// A route's shared budget is named in `RateLimit-Policy` when the store cannot decide too
/// (503 `store-unavailable` under `on_error: deny`): the policy is the config's, whatever the
/// store says. (It named the key's budget alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_names_the_shared_budget_when_the_store_is_down() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 250ms\n  on_error: deny\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 1000}}\n  endpoints:\n    /o: {{shared: {{max_cost: 30, window: 1h}}}}\n",
        redis.url()
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let policy = "\"default\";q=1000;w=3600, \"shared\";q=30;w=3600";
    let r = get(&c, gw.url("/o"), "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "RateLimit-Policy").as_deref(), Some(policy));
    redis.kill();
    let r = get(&c, gw.url("/o"), "k").await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "RateLimit-Policy").as_deref(), Some(policy));
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("0"));
}

/// A pool without a health check: an address that refuses the connection is not tried again
/// for the request, which goes to the pool's next address, whatever its method (it reached
/// none), and is charged once (DESIGN §1: round robin over healthy addresses). (Every third
/// request was a 502.)
#[tokio::test]
async fn a_pool_sends_a_request_one_address_refused_to_the_next() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "upstreams:\n  pool:\n    urls: [\"{}\", \"{}\", \"{}\"]\nrate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 100}}\n  endpoints:\n    \"/svc/{{*rest}}\": {{upstream: pool, strip_prefix: /svc}}\n",
        dead_url(),
        up.url(),
        dead_url(),
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    for i in 0..6 {
        let r = get(&c, gw.url(&format!("/svc/items?i={i}")), "pool-key").await;
        assert_eq!(r.status(), 200, "GET {i}");
        let r = c
            .post(gw.url(&format!("/svc/items?p={i}")))
            .header("X-API-Key", "pool-key")
            .body("a body")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "POST {i}");
        assert_eq!(
            header(&r, "X-RateLimit-Remaining").unwrap(),
            (98 - 2 * i).to_string()
        );
    }
    assert_eq!(up.count("/items"), 12);
}

/// Budgets with as few units left as each other: `X-RateLimit-*` (and `/admin/keys`) speak
/// for the one full again last, on both stores (`budget::tightest`, and its transcription in
/// the Lua script). A request that empties a 100/10s and a 100/100s budget said
/// `X-RateLimit-Reset: 10`: a client that came back then was refused.
async fn equally_tight_budgets_speak_for_the_slower(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 120}}\n  endpoints:\n    /big: {{cost: 100}}\nplans:\n  two:\n    budgets:\n      - {{ name: fast, max_cost: 100, window: 10s }}\n      - {{ name: slow, max_cost: 100, window: 100s }}\nkeys:\n  - {{ id: acme, sha256: \"{}\", plan: two }}\n",
        store(redis),
        sha256_hex("acme-key")
    );
    let gw = Gateway::start(&up, &body);
    let r = get(&client(), gw.url("/big"), "acme-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "RateLimit").as_deref(),
        Some("\"two-fast\";r=0;t=10, \"two-slow\";r=0;t=100")
    );
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("0"));
    assert_eq!(header(&r, "X-RateLimit-Reset").as_deref(), Some("100"));
    let v = admin_json(&gw, "/admin/keys/acme").await;
    assert_eq!(v["budget"], "two-slow", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equally_tight_budgets_speak_for_the_slower_on_memory_and_redis() {
    equally_tight_budgets_speak_for_the_slower(None).await;
    let redis = Redis::start();
    equally_tight_budgets_speak_for_the_slower(Some(&redis)).await;
}

/// A refusal by several budgets: the refusing one (the longest wait) sets `Retry-After`, and
/// `X-RateLimit-*` describe the tightest, the fewest units left (DESIGN §1). A stated cost of
/// 85 leaves `hour` (100/h) 15 units and `fast` (30/3s) 55 in debt; a request of 20 is then
/// refused by both, `hour` for 180 s and `fast` for under 8 s. The headers said `hour`'s 15
/// left of 100, which no client could spend.
async fn a_refusal_by_several_budgets_describes_the_tightest(redis: Option<&Redis>) {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 120}}\n  endpoints:\n    /s: {{cost: 10, cost_from_response: X-Actual-Cost}}\n    /r20: {{cost: 20}}\nplans:\n  ab:\n    budgets:\n      - {{ name: hour, max_cost: 100, window: 1h }}\n      - {{ name: fast, max_cost: 30, window: 3s }}\nkeys:\n  - {{ id: acme, sha256: \"{}\", plan: ab }}\n",
        store(redis),
        sha256_hex("acme-key")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let r = get(&c, gw.url("/s?actual_cost=85"), "acme-key").await;
    assert_eq!(r.status(), 200);
    let r = get(&c, gw.url("/r20"), "acme-key").await;
    assert_eq!(r.status(), 429);
    // `hour` needs 5 more units at 100 an hour: 180 s, less what drained since the stated
    // cost (rounded up: 180 unless a second passed between the two requests).
    let retry = header(&r, "Retry-After").unwrap();
    assert!(retry == "180" || retry == "179", "{retry}");
    assert_eq!(header(&r, "X-RateLimit-Limit").as_deref(), Some("30"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("0"));
    // `fast` is empty again 85 units at 10 a second after the stated cost: 9 s, rounded up.
    let reset: u64 = header(&r, "X-RateLimit-Reset").unwrap().parse().unwrap();
    assert!((8..=9).contains(&reset), "reset {reset}");
    let policy = header(&r, "RateLimit").unwrap();
    assert!(
        policy.starts_with("\"ab-hour\";r=15;t=") && policy.contains(", \"ab-fast\";r=0;t="),
        "{policy}"
    );
    // The problem's `remaining` is the headers' (it said 15).
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (v["remaining"].as_u64(), v["retry_after"].to_string()),
        (Some(0), retry.clone())
    );
    assert_eq!(
        v["detail"],
        format!("this request costs 20 units and 0 are left; retry in {retry} s")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_by_several_budgets_describes_the_tightest_on_memory_and_redis() {
    a_refusal_by_several_budgets_describes_the_tightest(None).await;
    let redis = Redis::start();
    a_refusal_by_several_budgets_describes_the_tightest(Some(&redis)).await;
}
