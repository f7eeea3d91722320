//! Several budgets per request (DESIGN §1, §3): plans with a minute and a day budget, charged
//! all or nothing, against the real gateway on both stores.

mod common;

use std::time::Duration;

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

    if let Some(redis) = redis {
        // Both budgets live under the key's hash tag (one Cluster slot, one script call).
        let keys = redis.cli(&["KEYS", "t{*"]);
        let mut keys: Vec<&str> = keys.lines().collect();
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
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(args)
            .arg("-c")
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
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
