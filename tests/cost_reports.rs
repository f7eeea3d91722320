//! `cost_from_response` (DESIGN §6): the upstream states what a request really cost, and the
//! charge settles on that number after the fact, on the memory store, on a Redis fleet and on
//! the `local` fallback; and a route's shared (provider) budget, which counts calls, is never
//! settled by it (nor by `cost_per_second`).
//!
//! Every budget here refills one unit in ≥ 36 s, so nothing a test waits for moves a figure.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// `/q` costs 1 and `/big` 5; both settle on `X-Actual-Cost`. Key `s-key` (id `s`) has 100
/// units an hour.
fn limits() -> String {
    format!(
        r#"rate_limits:
  default: {{ cost: 1, window: 1h, max_cost: 100 }}
  endpoints:
    /q: {{ cost: 1, cost_from_response: X-Actual-Cost }}
    /big: {{ cost: 5, cost_from_response: x-actual-cost }}
keys:
  - {{ id: s, sha256: "{}" }}
"#,
        sha256_hex("s-key")
    )
}

fn redis_store(redis: &Redis, extra: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n{extra}",
        redis.url()
    )
}

/// What `/admin/keys/s` says is left, once it answers (503 while the store is away).
async fn remaining(gw: &Gateway) -> Option<u64> {
    let r = reqwest::get(gw.admin("/admin/keys/s")).await.ok()?;
    if r.status() != 200 {
        return None;
    }
    let v: serde_json::Value = r.json().await.ok()?;
    // The shared budget's figure: during an outage `/admin/keys` shows the local share.
    if v["source"] == "local" {
        return None;
    }
    v["remaining"].as_u64()
}

async fn reports(gw: &Gateway, route: &str, result: &str) -> f64 {
    metric(
        gw,
        &format!("tollgate_cost_reports_total{{result=\"{result}\",route=\"{route}\"}}"),
    )
    .await
}

/// Sends `target` with key `s-key` through `gw`: the status and `X-RateLimit-Remaining`, once
/// the request's report (`result`, its `n`th on `route`) is counted, i.e. settled.
async fn send(gw: &Gateway, target: &str, result: &str, n: f64) -> (u16, u64) {
    let r = get(&client(), gw.url(target), "s-key").await;
    assert_eq!(
        header(&r, "x-actual-cost"),
        None,
        "the client never sees the stated cost ({target})"
    );
    let status = r.status().as_u16();
    let left = header(&r, "x-ratelimit-remaining").and_then(|v| v.parse().ok());
    let route = target.split('?').next().unwrap_or(target);
    assert_metric(
        gw,
        &format!("tollgate_cost_reports_total{{result=\"{result}\",route=\"{route}\"}}"),
        n,
    )
    .await;
    (status, left.unwrap_or(u64::MAX))
}

/// The sequence every store must settle alike: requests through `a`, figures read on `b`
/// (another instance of the fleet, or `a` itself).
async fn settles_stated_costs(a: &Gateway, b: &Gateway) {
    // Admitted (and shown) at 1, settled to 7.
    let r = get(&client(), a.url("/q?actual_cost=7"), "s-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("1"));
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("99"));
    assert_eq!(header(&r, "x-actual-cost"), None);
    assert!(r.text().await.unwrap().contains("actual_cost=7"));
    assert_metric(
        a,
        "tollgate_cost_reports_total{result=\"applied\",route=\"/q\"}",
        1.0,
    )
    .await;
    assert_eq!(remaining(b).await, Some(93), "7 in total, charged once");
    // Stated 0: the admission's unit comes back.
    assert_eq!(send(a, "/q?actual_cost=0", "applied", 2.0).await, (200, 92));
    assert_eq!(remaining(b).await, Some(93));
    // Stated 2 on a route that admits at 5: 3 come back.
    assert_eq!(
        send(a, "/big?actual_cost=2", "applied", 1.0).await,
        (200, 88)
    );
    assert_eq!(remaining(b).await, Some(91));
    // Above 100 × cost, not an integer, negative: ignored, the admission charge stands.
    assert_eq!(
        send(a, "/q?actual_cost=101", "invalid", 1.0).await,
        (200, 90)
    );
    assert_eq!(
        send(a, "/q?actual_cost=abc", "invalid", 2.0).await,
        (200, 89)
    );
    assert_eq!(
        send(a, "/q?actual_cost=-3", "invalid", 3.0).await,
        (200, 88)
    );
    assert_eq!(
        send(a, "/q?actual_cost=2.5", "invalid", 4.0).await,
        (200, 87)
    );
    // Missing: the admission charge stands.
    assert_eq!(send(a, "/q", "missing", 1.0).await, (200, 86));
    assert_eq!(remaining(b).await, Some(86));
    assert_eq!(reports(a, "/q", "applied").await, 2.0);
    // The other instance's next response shows the same budget.
    let r = get(&client(), b.url("/items"), "s-key").await;
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("85"));
    // The final charges: /q 7 + 0 + 1 × 5; /big 2 + 500.
    assert_metric(a, "tollgate_cost_units_total{route=\"/q\"}", 12.0).await;
    let costs: Vec<_> = a
        .wait_access(7, |e| e["route"] == "/q")
        .await
        .iter()
        .map(|e| e["cost"].as_u64().unwrap())
        .collect();
    assert_eq!(costs, vec![7, 0, 1, 1, 1, 1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stated_costs_settle_on_the_memory_store() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &limits());
    for result in ["applied", "missing", "invalid"] {
        assert_eq!(reports(&gw, "/q", result).await, 0.0, "announced at zero");
    }
    settles_stated_costs(&gw, &gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stated_costs_settle_once_on_a_redis_fleet() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    // Exact on purpose: `b` reads each settled figure at once, where with budget slices a
    // refund into `a`'s slice shows on `b` only once `a` settles it (its 500 ms life, then a sweep).
    let body = format!("{}{}", redis_store(&redis, "  slices: false\n"), limits());
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    settles_stated_costs(&a, &b).await;
    assert_eq!(
        reports(&b, "/q", "applied").await,
        0.0,
        "settled by a alone"
    );
}

/// A key in debt after a large stated cost waits out the whole debt: 10 units an hour (one
/// per 360 s), stated 50 → 41 units to drain before the next one fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_debt_waits_out_the_stated_cost() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        r#"rate_limits:
  default: { cost: 1, window: 1h, max_cost: 10 }
  endpoints:
    /q: { cost: 1, cost_from_response: X-Actual-Cost }
"#,
    );
    let c = client();
    let r = get(&c, gw.url("/q?actual_cost=50"), "d-key").await;
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-ratelimit-remaining")),
        (200, Some("9".into()))
    );
    assert_metric(
        &gw,
        "tollgate_cost_reports_total{result=\"applied\",route=\"/q\"}",
        1.0,
    )
    .await;
    let r = get(&c, gw.url("/q"), "d-key").await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after").as_deref(), Some("14760"));
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(up.count("/q"), 1);
}

/// A debt far past a budget (a stated cost may be 100 × the route's cost) is kept whole, on
/// the memory store as on Redis: 1001 units a day (one per 86.31 s) and a stated 100,100 leave
/// 99,100 units to drain before the next one fits. The memory store capped a bucket's level at
/// 2^51 ticks, about 26,060 of these units: it forgave three quarters of the debt
/// (`Retry-After` 2,163,237 where Redis said 8,553,687).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_debt_is_kept_whole_on_both_stores() {
    let up = Upstream::start(Duration::ZERO);
    let redis = Redis::start();
    let limits = "rate_limits:\n  default: { cost: 1, window: 24h, max_cost: 1001 }\n  endpoints:\n    /s: { cost: 1001, cost_from_response: X-Actual-Cost }\n";
    for store in [String::new(), redis_store(&redis, "")] {
        let gw = Gateway::start(&up, &format!("{store}{limits}"));
        let c = client();
        let r = get(&c, gw.url("/s?actual_cost=100100"), "d-key").await;
        assert_eq!(r.status(), 200);
        assert_metric(
            &gw,
            "tollgate_cost_reports_total{result=\"applied\",route=\"/s\"}",
            1.0,
        )
        .await;
        let r = get(&c, gw.url("/x"), "d-key").await;
        assert_eq!(r.status(), 429);
        // 99,100 units × 86,400 s / 1001 = 8,553,686.3 s, less the moments since.
        let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
        assert!(
            (8_553_686..=8_553_687).contains(&retry),
            "{store}: Retry-After {retry}"
        );
    }
}

/// A stated cost is in the store before the client has its answer: the key's next request,
/// on a new connection, sent the moment the answer came, finds the debt (DESIGN §6: the final
/// charge "becomes that number"). On Redis behind 100 ms each way, on a capped route, that
/// next request was admitted every time: the gateway settled after releasing the slot, a
/// round trip after the answer, and the next admission overtook it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_request_after_a_stated_cost_sees_it() {
    let redis = Redis::start();
    let slow = Proxy::start_delayed(redis.port, Duration::from_millis(100));
    let up = Upstream::start(Duration::ZERO);
    let limits = "rate_limits:\n  default: { cost: 1, window: 1h, max_cost: 10 }\n  endpoints:\n    /q: { cost: 1, cost_from_response: X-Actual-Cost, max_in_flight: 5 }\n";
    let on_redis = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 2s\n",
        slow.url()
    );
    for (i, store) in ["", &on_redis].into_iter().enumerate() {
        let gw = Gateway::start(&up, &format!("{store}{limits}"));
        for key in ["k1", "k2", "k3"] {
            let r = get(&client(), gw.url("/q?actual_cost=50"), key).await;
            assert_eq!(r.status(), 200, "{store}");
            // A client of its own: a new connection.
            let r = get(&client(), gw.url("/q"), key).await;
            assert_eq!(
                r.status(),
                429,
                "{store}{key}: the stated 50 was not settled yet"
            );
        }
        assert_eq!(up.count("/q"), 3 * (i as u64 + 1), "{store}");
    }
}

/// On the `local` fallback (Redis stopped) the settling happens in the local share, and what
/// was charged there in the end is written back once Redis returns: the stated 7, not the
/// admission's 1; a stated 0 not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stated_costs_on_the_local_fallback_are_written_back() {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}{}",
        redis_store(&redis, "  on_error: local\n  fleet_size: 1\n"),
        limits()
    );
    let gw = Gateway::start(&up, &body);
    redis.kill();
    assert_eq!(
        send(&gw, "/q?actual_cost=7", "applied", 1.0).await,
        (200, 99)
    );
    assert_eq!(
        send(&gw, "/q?actual_cost=0", "applied", 2.0).await,
        (200, 92)
    );
    assert_eq!(
        send(&gw, "/big?actual_cost=2", "applied", 1.0).await,
        (200, 88)
    );
    assert_eq!(send(&gw, "/q", "missing", 1.0).await, (200, 90));
    assert_metric(
        &gw,
        "tollgate_fallback_decisions_total{decision=\"admitted\"}",
        4.0,
    )
    .await;
    // 7 + 0 + 2 + 1 owed; written back into a Redis that restarted empty.
    let _redis = Redis::start_on(port);
    let start = Instant::now();
    while remaining(&gw).await != Some(90) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never written back: {:?}",
            remaining(&gw).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(remaining(&gw).await, Some(90), "written back once");
    let r = get(&client(), gw.url("/items"), "s-key").await;
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("89"));
}

/// Each member of a `RateLimit` header: name and `r`.
fn members(r: &reqwest::Response) -> Vec<(String, u64)> {
    let v = header(r, "ratelimit").unwrap_or_default();
    v.split(", ")
        .filter_map(|m| {
            let (name, rest) = m.split_once(';')?;
            let r = rest.split(';').find_map(|p| p.strip_prefix("r="))?;
            Some((name.trim_matches('"').to_string(), r.parse().ok()?))
        })
        .collect()
}

/// A route's shared budget counts calls: neither measured time nor (with `stated`) a stated
/// cost settles it, only the key's own budget.
async fn shared_budget_counts_calls(store: &str, stated: bool) {
    let up = Upstream::start(Duration::ZERO);
    let from_response = if stated {
        "      cost_from_response: X-Actual-Cost\n"
    } else {
        ""
    };
    let gw = Gateway::start(
        &up,
        &format!(
            r#"{store}rate_limits:
  default: {{ cost: 1, window: 1h, max_cost: 100 }}
  endpoints:
    /p:
      cost: 1
      cost_per_second: 4
{from_response}      shared: {{ max_cost: 50, window: 1h }}
"#
        ),
    );
    let c = client();
    let both =
        |key: u64, shared: u64| vec![("default".to_string(), key), ("shared".into(), shared)];
    // ~1.3 s at 4/s: the key pays 6, the provider's budget 1.
    let r = get(&c, gw.url("/p?delay_ms=1300"), "p-key").await;
    assert_eq!(members(&r), both(99, 49));
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/p\"}", 6.0).await;
    let r = get(&c, gw.url("/p"), "p-key").await;
    assert_eq!(members(&r), both(93, 48), "{store}");
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/p\"}", 7.0).await;
    if !stated {
        return;
    }
    // Stated 20: the key pays 20, the provider's budget 1; stated 0: the key pays nothing.
    let applied = "tollgate_cost_reports_total{result=\"applied\",route=\"/p\"}";
    let r = get(&c, gw.url("/p?actual_cost=20"), "p-key").await;
    assert_eq!(members(&r), both(92, 47));
    assert_metric(&gw, applied, 1.0).await;
    let r = get(&c, gw.url("/p?actual_cost=0"), "p-key").await;
    assert_eq!(members(&r), both(72, 46), "{store}");
    assert_metric(&gw, applied, 2.0).await;
    let r = get(&c, gw.url("/p"), "p-key").await;
    assert_eq!(members(&r), both(72, 45), "{store}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_charges_leave_the_shared_budget_alone_on_the_memory_store() {
    shared_budget_counts_calls("", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_charges_leave_the_shared_budget_alone_on_redis() {
    let redis = Redis::start();
    shared_budget_counts_calls(&redis_store(&redis, ""), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stated_costs_leave_the_shared_budget_alone_on_the_memory_store() {
    shared_budget_counts_calls("", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stated_costs_leave_the_shared_budget_alone_on_redis() {
    let redis = Redis::start();
    shared_budget_counts_calls(&redis_store(&redis, ""), true).await;
}

/// `tollgate audit` (and the `/admin/audit` it reads) puts each `cost_from_response` route's
/// mean stated cost beside its configured one, and flags a route whose cost is more than 2×
/// off it: `/q` (1, stated 5) is under-priced, `/analytics/query` (10, stated 3) over-priced,
/// `/big` (5, stated 4 and 6) is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_compares_stated_and_configured_costs() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        r#"rate_limits:
  default: { cost: 1, window: 1h, max_cost: 100000 }
  endpoints:
    /q: { cost: 1, cost_from_response: X-Actual-Cost }
    /big: { cost: 5, cost_from_response: X-Actual-Cost }
    /analytics/query: { cost: 10, cost_from_response: X-Actual-Cost }
    /plain: { cost: 1 }
"#,
    );
    let c = client();
    for i in 0..20 {
        let big = if i % 2 == 0 { 4 } else { 6 };
        for target in [
            "/q?actual_cost=5".to_string(),
            format!("/big?actual_cost={big}"),
            "/analytics/query?rows=2500".into(),
            "/plain".into(),
        ] {
            assert_eq!(get(&c, gw.url(&target), "a-key").await.status(), 200);
        }
    }
    // One the upstream got wrong: counted, and left out of the mean.
    get(&c, gw.url("/q?actual_cost=oops"), "a-key").await;
    for route in ["/q", "/big", "/analytics/query"] {
        let reports =
            format!("tollgate_cost_reports_total{{result=\"applied\",route=\"{route}\"}}");
        assert_metric(&gw, &reports, 20.0).await;
    }
    assert_metric(
        &gw,
        "tollgate_cost_reports_total{result=\"invalid\",route=\"/q\"}",
        1.0,
    )
    .await;

    let inst: serde_json::Value = admin_json(&gw, "/admin/audit").await;
    let q = route_entry(&inst, "/q");
    assert_eq!(
        q["stated"],
        serde_json::json!({"header": "x-actual-cost", "reports": 20, "sum": 100}),
        "{q}"
    );
    let plain = route_entry(&inst, "/plain");
    assert!(plain.get("stated").is_none(), "{plain}");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["audit", "--admin", &gw.admin(""), "--format", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stated = |name: &str| route_entry(&v, name)["stated"].clone();
    assert_eq!(
        stated("/q"),
        serde_json::json!({"header": "x-actual-cost", "reports": 20, "mean_cost": 5.0, "flag": "under-priced"})
    );
    assert_eq!(
        stated("/analytics/query"),
        serde_json::json!({"header": "x-actual-cost", "reports": 20, "mean_cost": 3.0, "flag": "over-priced"})
    );
    assert_eq!(
        stated("/big"),
        serde_json::json!({"header": "x-actual-cost", "reports": 20, "mean_cost": 5.0, "flag": null})
    );
    assert!(route_entry(&v, "/plain").get("stated").is_none());
    // The existing fields are all still there.
    for field in [
        "requests",
        "cost",
        "implied_cost",
        "flag",
        "worst_case",
        "p95_seconds",
    ] {
        assert!(route_entry(&v, "/q").get(field).is_some(), "{field}");
    }

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["audit", "--admin", &gw.admin("")])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    let head = table.lines().find(|l| l.starts_with("ROUTE")).unwrap();
    assert!(head.contains("  IMPLIED  STATED  "), "{table}");
    let line = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} in\n{table}"))
            .to_string()
    };
    assert!(
        line("/q").contains("!! under-priced vs stated 5.0"),
        "{table}"
    );
    assert!(
        line("/analytics/query").contains("!! over-priced vs stated 3.0"),
        "{table}"
    );
    assert!(!line("/big").contains("stated"), "{table}");
}

/// Asks `gw` for `/four` as `r-key` until it is admitted (refusals cost nothing), for at most
/// `within`: the admitted answer, which must leave 1 unit (4 of 5 back, then charged again).
async fn admitted_again(c: &reqwest::Client, gw: &Gateway, within: Duration, why: &str) {
    let admitted = eventually(within, async || {
        let r = get(c, gw.url("/four"), "r-key").await;
        match r.status().as_u16() {
            200 => Ok(r),
            429 => Err(why.to_string()),
            other => panic!("{other}"),
        }
    })
    .await;
    assert_eq!(
        header(&admitted, "x-ratelimit-remaining").as_deref(),
        Some("1")
    );
}

/// An instance whose give-back subscription goes deaf without closing (a middlebox that
/// drops the flow silently) stops answering from the refusals it keeps: it no longer hears
/// its own heartbeat, takes the subscription for lost, and asks Redis again. Here `a`'s path
/// to Redis holds every message Redis pushes to `a`'s subscription (its calls still pass);
/// `b`'s refund never reaches `a`, and `a` still admits the request that now fits, within
/// the 3 s the heartbeat allows plus a beat. (Without the heartbeat `a` kept the refusal for
/// the 36 minutes until Redis said the cost could fit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deaf_subscription_keeps_no_refusal() {
    let redis = Redis::start();
    let path_of_a = Proxy::start(redis.port);
    let up = Upstream::start(Duration::ZERO);
    let limits = "rate_limits:\n  default: { cost: 1, window: 1h, max_cost: 5 }\n  endpoints:\n    /four: { cost: 4, cost_from_response: X-Actual-Cost }\n";
    let via = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n",
        path_of_a.url()
    );
    let a = Gateway::start(&up, &format!("{via}{limits}"));
    let b = Gateway::start(&up, &format!("{}{limits}", redis_store(&redis, "")));
    let c = client();
    let slow = tokio::spawn({
        let (c, url) = (c.clone(), b.url("/four?delay_ms=8000&actual_cost=0"));
        async move { get(&c, url, "r-key").await }
    });
    up.wait_current("/four", 1).await;
    // `a` refuses the next 4 (1 left) and keeps the refusal: a repeat asks Redis nothing.
    eventually(Duration::from_secs(10), async || {
        let before = redis.evalsha_calls();
        let r = get(&c, a.url("/four"), "r-key").await;
        assert_eq!(r.status(), 429);
        match redis.evalsha_calls() == before {
            true => Ok(()),
            false => Err("`a` asked Redis".to_string()),
        }
    })
    .await;
    // What Redis pushes to `a`'s subscription is held from now on (not its calls or beats),
    // before `b`'s refund (else the test would not be about a deaf subscription).
    path_of_a.hold_matching("message\r\n$19\r\ntollgate:given-back");
    assert!(
        !slow.is_finished(),
        "the refund came before the subscription went deaf"
    );
    assert_eq!(slow.await.unwrap().status(), 200);
    admitted_again(
        &c,
        &a,
        Duration::from_secs(15),
        "`a` still refuses from memory",
    )
    .await;
    assert_eq!(up.count("/four"), 2);
}

/// A refund on one instance frees the units on every other at once. An instance keeps a
/// refusal Redis made (and answers its repeats from memory until Redis said the cost could
/// fit); `b`'s stated 0 gives 4 units back while `a` remembers refusing them, and `a` refused
/// the request that now fitted for the next 12 minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_elsewhere_ends_a_remembered_refusal() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}rate_limits:\n  default: {{ cost: 1, window: 1h, max_cost: 5 }}\n  endpoints:\n    /four: {{ cost: 4, cost_from_response: X-Actual-Cost }}\n",
        redis_store(&redis, "")
    );
    let (a, b) = (Gateway::start(&up, &body), Gateway::start(&up, &body));
    let c = client();
    // Taken by a slow request on `b` that will state 0...
    let slow = tokio::spawn({
        let (c, url) = (c.clone(), b.url("/four?delay_ms=5000&actual_cost=0"));
        async move { get(&c, url, "r-key").await }
    });
    up.wait_current("/four", 1).await;
    // ...so that `a` refuses the next 4 (1 left), and remembers it.
    for _ in 0..2 {
        let r = get(&c, a.url("/four"), "r-key").await;
        assert_eq!(r.status(), 429);
        assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("1"));
    }
    let r = slow.await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("1"));
    // The 4 are back: `a` admits the next request. Refusals are never charged, so the test
    // may ask again while the news travels (Redis Pub/Sub, well under a second; without it
    // `a` refused for 12 minutes).
    let why = "`a` still refuses after `b` gave the units back";
    admitted_again(&c, &a, Duration::from_secs(10), why).await;
    assert_eq!(up.count("/four"), 2);
}

/// DESIGN §6: the stated cost's header "is removed before the client sees the response" —
/// also from an interim `103 Early Hints` the upstream sends first (the rest of it, `Link`,
/// is relayed). Only the final answer's figure counts: 5, not the hint's 99. (Before, the
/// 103 reached the client with `X-Actual-Cost: 99`.)
#[test]
fn a_stated_cost_in_early_hints_is_not_relayed() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = conn.write_all(
                b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\nX-Actual-Cost: 99\r\n\r\n\
                  HTTP/1.1 200 OK\r\nX-Actual-Cost: 5\r\nContent-Length: 2\r\n\r\nok",
            );
        }
    });
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("http://127.0.0.1:{port}"),
        body: "rate_limits:\n  default: { cost: 1, window: 1h, max_cost: 100 }\n  endpoints:\n    /q: { cost: 10, cost_from_response: X-Actual-Cost }\n",
        ..GatewayOpts::default()
    });
    let mut s = raw_connect(gw.port);
    s.write_all(
        b"GET /q HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-hints\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 103"), "{text}");
    assert!(
        text.contains("\r\nlink: </a.css>; rel=preload\r\n"),
        "{text}"
    );
    assert!(!text.contains("x-actual-cost"), "{text}");
    assert!(text.contains("http/1.1 200"), "{text}");
    // The next request sees the first settled to its stated 5 (not 99): admitted at 10, it
    // leaves 100 - 5 - 10.
    let mut s = raw_connect(gw.port);
    s.write_all(&raw("GET /q", &["X-API-Key: k-hints"]))
        .unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(text.contains("\r\nx-ratelimit-remaining: 85\r\n"), "{text}");
}
