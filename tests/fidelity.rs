//! Cost fidelity (DESIGN §6) as an operator meets it: `tollgate audit` over a real fleet,
//! `mode: shadow` on live traffic, and `cost_per_second` billing measured upstream time.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Runs `tollgate audit` with `args`; returns stdout and the exit code.
fn audit(args: &[&str]) -> (String, i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("audit")
        .args(args)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

async fn admin_audit(gw: &Gateway) -> tollgate::audit::InstanceAudit {
    reqwest::get(gw.admin("/admin/audit"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

const FLEET_LIMITS: &str = r#"rate_limits:
  default: { cost: 1, window: 1h, max_cost: 10000 }
  endpoints:
    /a: { cost: 1 }
    /b: { cost: 1 }
    /slow: { cost: 1 }
"#;

/// Two instances on one Redis, traffic split 12/8 so that neither alone has enough: the audit
/// of both adds up exactly, reads percentiles from the merged buckets, flags the route whose
/// upstream takes 30× what its cost says, and names the instance that did not answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_merges_a_redis_fleet_and_flags_the_slow_route() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n{FLEET_LIMITS}",
        redis.url()
    );
    let gws = [Gateway::start(&up, &body), Gateway::start(&up, &body)];
    let c = client();
    for (gw, n) in gws.iter().zip([12, 8]) {
        for (path, ms) in [("/a", 10), ("/b", 10), ("/slow", 300)] {
            let rs = all_at_once(n, |_| {
                c.get(gw.url(&format!("{path}?delay_ms={ms}")))
                    .header("X-API-Key", "fleet-key")
            })
            .await;
            assert_eq!(sorted_statuses(&rs), vec![200; n]);
        }
    }
    // Recorded in the logging phase, just after each response: wait for the last ones.
    for (gw, n) in gws.iter().zip([12.0, 8.0]) {
        assert_metric(gw, "tollgate_cost_units_total{route=\"/slow\"}", n).await;
    }
    let instances = [admin_audit(&gws[0]).await, admin_audit(&gws[1]).await];
    let dead = format!("http://127.0.0.1:{}", free_port());
    let (a0, a1) = (gws[0].admin(""), gws[1].admin(""));

    let (out, code) = audit(&[
        "--admin", &a0, "--admin", &a1, "--admin", &dead, "--format", "json",
    ]);
    assert_eq!(
        code, 2,
        "an unreachable instance shows in the exit code:\n{out}"
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let inst = v["instances"].as_array().unwrap();
    assert_eq!(inst.len(), 3);
    assert_eq!(inst[2]["admin"], dead.as_str());
    assert_eq!(inst[2]["ok"], false);
    for name in ["/a", "/b", "/slow"] {
        let r = route_entry(&v, name);
        assert_eq!(
            (r["requests"].as_u64(), r["upstream_requests"].as_u64()),
            (Some(20), Some(20)),
            "{r}"
        );
        assert_eq!(r["too_little_traffic"], false, "{r}");
        // Exactly the instances' buckets added up, then read.
        let mut merged = instances[0]
            .routes
            .iter()
            .find(|x| x.route == name)
            .unwrap()
            .upstream
            .clone();
        let other = &instances[1]
            .routes
            .iter()
            .find(|x| x.route == name)
            .unwrap()
            .upstream;
        assert!(merged.merge(other));
        assert_eq!(merged.count, 20);
        assert_eq!(r["p50_seconds"].as_f64(), merged.quantile(0.5), "{name}");
        assert_eq!(r["p95_seconds"].as_f64(), merged.quantile(0.95), "{name}");
    }
    // Each instance alone has too little traffic to say anything.
    for i in &instances {
        let slow = i.routes.iter().find(|x| x.route == "/slow").unwrap();
        assert!(slow.upstream.count < tollgate::audit::MIN_SAMPLES);
    }
    let slow = route_entry(&v, "/slow");
    let p95 = slow["p95_seconds"].as_f64().unwrap();
    assert!((0.25..=0.5).contains(&p95), "{p95}");
    let implied = slow["implied_cost"].as_f64().unwrap();
    // ~30 on a quiet machine (300 ms against a ~10 ms baseline); a loaded one slows the fast
    // baseline routes more than the slow one, so only the order of magnitude is asserted.
    assert!((4.0..=40.0).contains(&implied), "implied {implied}");
    assert_eq!(slow["flag"], "under-priced");
    let mean = slow["mean_seconds"].as_f64().unwrap();
    let worst = slow["worst_case"][0]["backend_seconds_per_minute"]
        .as_f64()
        .unwrap();
    assert!(
        (worst - 10000.0 / 1.0 * 60.0 / 3600.0 * mean).abs() < 1e-6,
        "{worst}"
    );
    assert_eq!(v["routes"][0]["route"], "/slow", "worst first");
    for name in ["/a", "/b"] {
        assert!(route_entry(&v, name)["flag"].is_null());
    }

    // The table says the same, and names the dead instance.
    let (table, code) = audit(&["--admin", &a0, "--admin", &a1, "--admin", &dead]);
    assert_eq!(code, 2);
    assert!(table.contains(&format!("UNREACHABLE {dead}")), "{table}");
    assert!(table.contains("instances: 2 of 3 answered"), "{table}");
    let slow_line = table.lines().find(|l| l.starts_with("/slow ")).unwrap();
    assert!(slow_line.contains("!! under-priced"), "{table}");

    // Priced as it runs (an edited file, audited before it is deployed): no flag.
    let edited = gws[0].dir.path().join("edited.yaml");
    let text = std::fs::read_to_string(&gws[0].config_path)
        .unwrap()
        .replace("/slow: { cost: 1 }", "/slow: { cost: 30 }");
    std::fs::write(&edited, text).unwrap();
    let (out, code) = audit(&[
        "-c",
        edited.to_str().unwrap(),
        "--admin",
        &a0,
        "--admin",
        &a1,
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let slow = route_entry(&v, "/slow");
    assert_eq!(
        (slow["cost"].as_u64(), slow["flag"].is_null()),
        (Some(30), true),
        "{slow}"
    );
}

/// DESIGN §6: `GET /admin/audit` (one instance's view) has, per route, the implied cost, the
/// flag and the worst case one key can impose, as `tollgate audit` does for a fleet, on this
/// instance's figures. (Before, only the raw figures: the findings were the CLI's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_audit_has_the_findings_of_its_instance() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, FLEET_LIMITS);
    let c = client();
    for (path, ms) in [("/a", 10), ("/b", 10), ("/slow", 300)] {
        let rs = all_at_once(20, |_| {
            c.get(gw.url(&format!("{path}?delay_ms={ms}")))
                .header("X-API-Key", "k")
        })
        .await;
        assert_eq!(sorted_statuses(&rs), vec![200; 20]);
    }
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/slow\"}", 20.0).await;
    let v = admin_json(&gw, "/admin/audit").await;
    let baseline = v["baseline_seconds"].as_f64().unwrap();
    assert!((0.01..0.1).contains(&baseline), "{v}");
    let slow = route_entry(&v, "/slow");
    assert_eq!(slow["flag"], "under-priced", "{slow}");
    assert_eq!(slow["too_little_traffic"], false, "{slow}");
    let mean = slow["mean_seconds"].as_f64().unwrap();
    let implied = slow["implied_cost"].as_f64().unwrap();
    assert!((implied - mean / baseline).abs() < 1e-9, "{slow}");
    // max_cost / cost × 60 / window_seconds × mean: 10000 / 1 × 60 / 3600 × mean.
    let worst = &slow["worst_case"][0];
    assert_eq!(worst["plan"], "default", "{slow}");
    let want = 10000.0 * 60.0 / 3600.0 * mean;
    assert!(
        (worst["backend_seconds_per_minute"].as_f64().unwrap() - want).abs() < 1e-9,
        "{slow}"
    );
    let a = route_entry(&v, "/a");
    assert!(a["flag"].is_null() && a["implied_cost"].is_number(), "{a}");
    // `tollgate audit` still reads it.
    let (out, code) = audit(&["--admin", &gw.admin(""), "--format", "json"]);
    assert_eq!(code, 0, "{out}");
}

/// `mode: shadow`: a request the budget would refuse is forwarded uncharged, counted with its
/// reason, and described by the headers as if refused; a full cap is counted, not waited on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_forwards_would_be_refusals_uncharged() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        r#"rate_limits:
  default: { cost: 1, window: 1h, max_cost: 3 }
  endpoints:
    /reports/generate: { cost: 2, mode: shadow }
    /capped: { cost: 1, max_in_flight: 1, queue_timeout: 5s, mode: shadow }
"#,
    );
    let c = client();
    let first = post(&c, gw.url("/reports/generate"), "k1").await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        header(&first, "x-ratelimit-remaining").as_deref(),
        Some("1")
    );
    // Would be a 429 (2 units asked, 1 left): forwarded, uncharged, headers as if refused.
    let second = post(&c, gw.url("/reports/generate"), "k1").await;
    assert_eq!(second.status(), 200);
    assert_eq!(
        header(&second, "x-ratelimit-remaining").as_deref(),
        Some("1")
    );
    assert_eq!(header(&second, "x-ratelimit-cost").as_deref(), Some("0"));
    assert_eq!(
        header(&second, "ratelimit-policy").as_deref(),
        Some("\"default\";q=3;w=3600")
    );
    assert_eq!(up.count("/reports/generate"), 2);
    assert_metric(
        &gw,
        "tollgate_shadow_rejections_total{reason=\"budget\",route=\"/reports/generate\"}",
        1.0,
    )
    .await;
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/reports/generate\"}",
        2.0,
    )
    .await;
    // Nothing was charged beyond the enforced config's 2: the key's last unit is still there,
    // and the enforced default route refuses after it.
    let third = get(&c, gw.url("/items/1"), "k1").await;
    assert_eq!(
        (
            third.status().as_u16(),
            header(&third, "x-ratelimit-remaining")
        ),
        (200, Some("0".into()))
    );
    assert_eq!(get(&c, gw.url("/items/1"), "k1").await.status(), 429);

    // The cap: one holds the slot, the other is counted at once (no 5 s queue) and holds none.
    let start = std::time::Instant::now();
    let rs = all_at_once(2, |i| {
        c.get(gw.url(&format!("/capped?delay_ms={}", 600 + 300 * i)))
            .header("X-API-Key", "k2")
    })
    .await;
    assert_eq!(sorted_statuses(&rs), vec![200, 200]);
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "a shadow route never queues"
    );
    assert_eq!(up.max_concurrent("/capped"), 2);
    assert_metric(
        &gw,
        "tollgate_shadow_rejections_total{reason=\"route_busy\",route=\"/capped\"}",
        1.0,
    )
    .await;
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/capped\"}", 1.0).await;
    let shadowed = gw.wait_access(2, |e| e["decision"] == "shadow").await;
    assert_eq!(shadowed.len(), 2, "{shadowed:?}");
    assert!(shadowed
        .iter()
        .all(|e| e["cost"] == 0 && e["status"] == 200));
    assert_eq!(shadowed[0]["shadow"], "budget");
}

/// A shadow route never waits for its `max_delay` turn either (shadow mode adds no latency):
/// what enforcement would hold is forwarded at once, charged as enforcement would charge it,
/// on a capped route as on another. Trying a cost of 60 in shadow on a 120/10s budget with
/// `max_delay: 5s` held the third request for 5 s.
async fn shadow_never_holds(store: &str) {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            r#"{store}rate_limits:
  default: {{ cost: 1, window: 10s, max_cost: 120, max_delay: 5s }}
  endpoints:
    /new: {{ cost: 60, mode: shadow }}
    /capped: {{ cost: 60, mode: shadow, max_in_flight: 5, queue_timeout: 5s }}
"#
        ),
    );
    let c = client();
    for (path, key) in [("/new", "h1"), ("/capped", "h2")] {
        let start = std::time::Instant::now();
        for _ in 0..3 {
            let r = get(&c, gw.url(path), key).await;
            assert_eq!(r.status(), 200, "{path}");
        }
        // Enforced, the third would wait 5 s for its units.
        assert!(
            start.elapsed() < Duration::from_millis(2500),
            "{store} {path}: {:?}",
            start.elapsed()
        );
    }
    let held: Vec<_> = gw
        .wait_access(6, |e| e["route"] == "/new" || e["route"] == "/capped")
        .await;
    assert!(held.iter().all(|e| e["hold_ms"] == 0.0), "{held:?}");
    assert_eq!(up.count("/new") + up.count("/capped"), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_never_holds_on_memory_and_redis() {
    shadow_never_holds("").await;
    let redis = Redis::start();
    shadow_never_holds(&format!(
        "store:\n  backend: redis\n  url: \"{}\"\n",
        redis.url()
    ))
    .await;
}

/// A ~1.3 s query at 4 units/s: admitted (and shown) at its cost of 1, charged 6 in total
/// once it has run: ceil(1.3 × 4). (Exactly 1.5 s would measure a few ms more and bill 7.)
async fn bills_measured_time(store: &str) {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            r#"{store}rate_limits:
  default: {{ cost: 1, window: 1h, max_cost: 100 }}
  endpoints:
    /analytics/query: {{ cost: 1, cost_per_second: 4 }}
keys:
  - {{ id: q, sha256: "{}" }}
"#,
            sha256_hex("q-key")
        ),
    );
    let c = client();
    let r = get(&c, gw.url("/analytics/query?delay_ms=1300"), "q-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-ratelimit-cost").as_deref(),
        Some("1"),
        "the admission charge"
    );
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("99"));
    // The counter moves after the time charge reached the store.
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/analytics/query\"}",
        6.0,
    )
    .await;
    assert_eq!(remaining(&gw, "q").await, 94, "{store}");
    let logged = gw
        .wait_access(1, |e| e["route"] == "/analytics/query")
        .await;
    assert_eq!(logged.len(), 1);
    assert_eq!(logged[0]["cost"], 6);
    // A fast one pays its cost, never less.
    let r = get(&c, gw.url("/analytics/query"), "q-key").await;
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("93"));
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/analytics/query\"}",
        7.0,
    )
    .await;
    assert_eq!(remaining(&gw, "q").await, 93);
    // Twice as long, about twice the charge: ceil(2.6 × 4) = 11 against 6.
    let r = get(&c, gw.url("/analytics/query?delay_ms=2600"), "q-key").await;
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("1"));
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/analytics/query\"}",
        18.0,
    )
    .await;
    assert_eq!(remaining(&gw, "q").await, 82, "{store}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_second_bills_time_on_the_memory_store() {
    bills_measured_time("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_second_bills_time_on_redis() {
    let redis = Redis::start();
    bills_measured_time(&format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n",
        redis.url()
    ))
    .await;
}

/// `cost_per_second` charges the extra after the fact even when it leaves the bucket in debt
/// (DESIGN §6): a ~2.3 s query at 4 units/s is charged 10 against a budget of 8, and the key
/// then waits for the debt as well — its next call (cost 1) fits once 3 units have drained,
/// at 8 an hour: Retry-After 1,350 s (less what drained while the query ran).
async fn time_billed_into_debt(store: &str) {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            "{store}rate_limits:\n  default: {{ cost: 1, window: 1h, max_cost: 8 }}\n  endpoints:\n    /analytics/query: {{ cost: 1, cost_per_second: 4 }}\nkeys:\n  - {{ id: q, sha256: \"{}\" }}\n",
            sha256_hex("q-key")
        ),
    );
    let c = client();
    let r = get(&c, gw.url("/analytics/query?delay_ms=2300"), "q-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("1"));
    // ceil(2.3 × 4) = 10 (11 should the machine be slow past 2.5 s): beyond the 8 the
    // budget holds.
    let logged = gw
        .wait_access(1, |e| e["route"] == "/analytics/query")
        .await;
    let charged = logged[0]["cost"].as_u64().unwrap();
    assert!((10..=11).contains(&charged), "charged {charged}");
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/analytics/query\"}",
        charged as f64,
    )
    .await;
    let r = get(&c, gw.url("/analytics/query"), "q-key").await;
    assert_eq!(r.status(), 429, "{store}");
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("0"));
    // Fits once the level is down to 7: `charged - 7` units at 450 s each, less the few
    // seconds the admission's unit has drained since it was charged.
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    let debt = (charged - 7) * 450;
    assert!(
        (debt - 4..=debt).contains(&retry),
        "{store}: Retry-After {retry}, charged {charged}"
    );
    assert_eq!(up.count("/analytics/query"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_billed_into_debt_is_waited_for_on_the_memory_store() {
    time_billed_into_debt("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_billed_into_debt_is_waited_for_on_redis() {
    let redis = Redis::start();
    time_billed_into_debt(&format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n",
        redis.url()
    ))
    .await;
}

/// `/admin/audit` is behind the admin token like every `/admin/*` path; `tollgate audit`
/// sends `TOLLGATE_ADMIN_TOKEN` and says what a 401 means.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_uses_the_admin_token() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: "rate_limits:\n  default: { cost: 1, window: 1h, max_cost: 10 }\n",
        env: vec![("TOLLGATE_ADMIN_TOKEN", "s3cret-admin-7f2c91d4".into())],
        ..GatewayOpts::default()
    });
    assert_eq!(
        reqwest::get(gw.admin("/admin/audit"))
            .await
            .unwrap()
            .status(),
        401
    );
    let admin = gw.admin("");
    let run = |token: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        cmd.args(["audit", "--admin", &admin])
            .env_remove("TOLLGATE_ADMIN_TOKEN");
        if let Some(t) = token {
            cmd.env("TOLLGATE_ADMIN_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            out.status.code(),
        )
    };
    let (out, code) = run(None);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("answered 401 (set TOLLGATE_ADMIN_TOKEN"),
        "{out}"
    );
    assert!(!out.contains("s3cret"), "{out}");
    let (out, code) = run(Some("s3cret-admin-7f2c91d4"));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("instances: 1 of 1 answered"), "{out}");
    assert!(out.contains("too little traffic (0 < 20)"), "{out}");
}

/// Upstream time runs to the final answer's head, not to an interim `100 Continue`: a client
/// that sends `Expect: 100-continue` pays for the 1.5 s the upstream worked after it, as one
/// without it does (before, the clock stopped at the 100 and the request paid 1 unit). At
/// 1 unit/s the charge is 2 for anything from 1 s to 2 s: the client's own round trip for the
/// 100, inside the measured time, may take long on a busy machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_second_bills_the_time_after_a_100_continue() {
    use std::io::Write;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /upload: {cost: 1, cost_per_second: 1}\n",
    );
    let mut sock = raw_connect(gw.port);
    sock.write_all(b"POST /upload?then_ms=1500 HTTP/1.1\r\nHost: localhost\r\nX-API-Key: expecting\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        .unwrap();
    let interim = tokio::task::block_in_place(|| read_interim(&mut sock));
    assert_eq!(interim, Some(100));
    sock.write_all(b"hello").unwrap();
    let r = tokio::task::block_in_place(|| read_raw_response(&mut sock)).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-cost"),
        Some("1"),
        "the admission charge"
    );
    // 1.5 s × 1 unit/s, rounded up: 2 in all.
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/upload\"}", 2.0).await;
    let logged = gw.wait_access(1, |e| e["route"] == "/upload").await;
    assert_eq!(logged[0]["cost"], 2, "{logged:?}");
    assert_eq!(logged[0]["status"], 200, "{logged:?}");
}

/// An instance named twice (the same address, or another spelling of it) is counted once:
/// each `/admin/audit` names its instance, and the audit says which names were the same.
/// (Its requests were counted twice, and "2 of 2 answered".)
#[tokio::test]
async fn an_instance_named_twice_is_audited_once() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, FLEET_LIMITS);
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, gw.url("/a"), "k").await.status(), 200);
    }
    let other = format!("http://localhost:{}/", gw.admin_port);
    let (out, code) = audit(&[
        "--admin",
        &gw.admin(""),
        "--admin",
        &other,
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let a = route_entry(&v, "/a");
    assert_eq!(a["requests"], 3, "{out}");
    assert_eq!(v["instances"][1]["same_as"], gw.admin(""), "{out}");
    let (out, _) = audit(&["--admin", &gw.admin(""), "--admin", &other]);
    assert!(out.contains("instances: 2 of 2 answered"), "{out}");
    assert!(
        out.contains(&format!("{other}: the same instance as {}", gw.admin(""))),
        "{out}"
    );
}

/// Instances whose configs price routes differently (mid-rollout, or one not reloaded) are
/// audited against the first one's costs, and the audit says so, naming each config and where
/// it runs; `-c` audits against one file and says nothing. It said nothing, with the first's
/// costs. Configs that differ elsewhere (each instance's own ports) are not said to differ.
#[tokio::test]
async fn instances_on_different_configs_are_said_to_differ() {
    let up = Upstream::start(Duration::ZERO);
    let first = Gateway::start(&up, FLEET_LIMITS);
    let same = Gateway::start(&up, FLEET_LIMITS);
    let (out, _) = audit(&["--admin", &first.admin(""), "--admin", &same.admin("")]);
    assert!(!out.contains("CONFIGS DIFFER"), "{out}");
    let second = Gateway::start(
        &up,
        &FLEET_LIMITS.replace("/a: { cost: 1 }", "/a: { cost: 2 }"),
    );
    let h1 = admin_json(&first, "/admin/audit").await["config_hash"].clone();
    let h2 = admin_json(&second, "/admin/audit").await["config_hash"].clone();
    let (h1, h2) = (h1.as_str().unwrap(), h2.as_str().unwrap());
    assert_ne!(h1, h2);
    let (a1, a2) = (first.admin(""), second.admin(""));
    let (out, code) = audit(&["--admin", &a1, "--admin", &a2]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!(
            "CONFIGS DIFFER: {h1} at {a1}, {h2} at {a2}; the costs below are {a1}'s"
        )),
        "{out}"
    );
    let (out, _) = audit(&["--admin", &a1, "--admin", &a2, "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["configs_differ"],
        serde_json::json!([{"admin": a1, "config_hash": h1}, {"admin": a2, "config_hash": h2}]),
        "{out}"
    );
    let file = first.config_path.to_str().unwrap();
    let (out, _) = audit(&["-c", file, "--admin", &a1, "--admin", &a2]);
    assert!(!out.contains("CONFIGS DIFFER"), "{out}");
    // One config everywhere: nothing to say.
    let (out, _) = audit(&["--admin", &a1]);
    assert!(!out.contains("CONFIGS DIFFER"), "{out}");
}

/// `tollgate audit` names each `--admin` as the store's URL is named: a password in its user
/// information, or a token in its query, is not repeated to the terminal (or a CI log), in the
/// table or in JSON. (Before, `UNREACHABLE http://u:<password>@…`.)
#[test]
fn audit_does_not_repeat_credentials_in_an_admin_url() {
    let dead = format!(
        "http://ops:sekret-pw@127.0.0.1:{}/?token=sekret-q",
        free_port()
    );
    for format in ["table", "json"] {
        let (out, code) = audit(&["--admin", &dead, "--format", format]);
        assert_eq!(code, 1, "{out}");
        assert!(!out.contains("sekret"), "{out}");
        assert!(out.contains("ops:***@127.0.0.1"), "{out}");
    }
}
