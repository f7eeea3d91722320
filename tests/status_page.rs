//! The status page (`GET /admin/`, DESIGN §5) in a real headless Chromium, on a gateway whose
//! capped route is held full on Redis: the numbers the page shows are the live ones. Also
//! `/admin/routes`'s last-minute counts, `/admin/status`, and the admin token's sign-in.
//!
//! Needs Debian's `chromium` (scripts/test.sh installs it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const TOKEN: &str = "status-page-test-token-0123456789";

/// Registry keys `a`, `b` (plan `gold`) and `c` (plan `tiny`; raw keys `key-a`...), a
/// route capped at 2, and two uncapped ones.
fn config() -> String {
    let keys: String = [("a", "gold"), ("b", "gold"), ("c", "tiny")]
        .iter()
        .map(|(id, plan)| registry_key(id, &format!(", plan: {plan}")))
        .collect();
    format!(
        "rate_limits:
  default: {{cost: 1, window: 24h, max_cost: 1000}}
  endpoints:
    /reports/generate: {{cost: 20, max_in_flight: 2, queue_timeout: 60s}}
    /exports/bulk: {{cost: 20}}
    /items: {{cost: 1}}
    /jobs/run: {{cost: 1, max_in_flight: 1, queue_timeout: 60s, async: {{when: always}}}}
plans:
  gold: {{max_cost: 1000, window: 24h, weight: 2}}
  tiny: {{max_cost: 20, window: 24h}}
  silver:
    budgets:
      - {{name: minute, max_cost: 120, window: 60s}}
      - {{name: day, max_cost: 20000, window: 24h}}
keys:
{keys}"
    )
}

fn chromium() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join(name))
                    .find(|p| p.is_file())
            })
        })
        .expect("no chromium on PATH: install Debian's `chromium` (scripts/test.sh does)")
}

/// Runs headless Chromium on `url` with `args` (`--dump-dom` or `--screenshot=…`) and a fresh
/// profile; returns its stdout.
fn browse(url: &str, args: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium())
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            // Virtual time runs the page's timers and fetches without waiting in real time;
            // the budget covers the sign-in, the reload and the first refresh.
            "--virtual-time-budget=15000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of the element with `class` inside the first element of the DOM that carries
/// `marker` (an attribute, e.g. `data-route="/reports/generate"`), up to the end of its row.
fn cell(dom: &str, marker: &str, class: &str) -> String {
    let row = &dom[dom
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker} in the page:\n{dom}"))..];
    let row = &row[..row.find("</tr>").unwrap_or(row.len())];
    let at = row
        .find(&format!("class=\"{class}\""))
        .or_else(|| row.find(&format!("class=\"n {class}\"")))
        .unwrap_or_else(|| panic!("no .{class} in the row {marker}:\n{row}"));
    let text = &row[at..];
    let text = &text[text.find('>').unwrap() + 1..];
    text[..text.find('<').unwrap()].to_string()
}

fn text_of_id(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page:\n{dom}"));
    let text = &dom[at..];
    let text = &text[text.find('>').unwrap() + 1..];
    text[..text.find('<').unwrap()].to_string()
}

fn artefact(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status_page");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A gateway with the admin token before `up`, on `redis` with `on_error: local` and `more`
/// (lines under `store:`).
fn on_redis(redis: &Redis, up: &Upstream, more: &str) -> Gateway {
    let body = format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 250ms\n  on_error: local\n{more}{}",
        redis.url(),
        config()
    );
    Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        env: vec![("TOLLGATE_ADMIN_TOKEN", TOKEN.to_string())],
        ..GatewayOpts::default()
    })
}

/// `/admin/*` with the token, as the tests outside the browser ask it.
async fn admin_get(gw: &Gateway, path: &str) -> serde_json::Value {
    let r = client()
        .get(gw.admin(path))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r.json().await.unwrap()
}

/// Key c's exports: the first admitted, the next `refused` ones refused by its 20-unit budget.
async fn exports_of_key_c(gw: &Gateway, refused: usize) {
    let c = client();
    assert_eq!(
        post(&c, gw.url("/exports/bulk"), "key-c").await.status(),
        200
    );
    for _ in 0..refused {
        assert_eq!(
            post(&c, gw.url("/exports/bulk"), "key-c").await.status(),
            429
        );
    }
}

/// Key a holds both slots of `/reports/generate` (slow upstream requests), key b waits for
/// one; the page, loaded in Chromium through the token's sign-in (`#token=`), shows cap 2,
/// running 2, queued 1, a holding 2 and b waiting 1, key c's refusal, the plans and the
/// store's state. A screenshot is kept under target/tmp/status_page/.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_page_shows_the_live_numbers_in_a_browser() {
    let redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = on_redis(&redis, &up, "  fleet_size: 2\n  lease_ttl: 3s\n");
    exports_of_key_c(&gw, 1).await;
    let c = client();
    let mut tasks = vec![];
    for key in ["key-a", "key-a", "key-b"] {
        let req = c
            .post(gw.url("/reports/generate?delay_ms=60000"))
            .header("X-API-Key", key);
        tasks.push(tokio::spawn(
            async move { req.send().await.map(|r| r.status()) },
        ));
        if tasks.len() == 2 {
            up.wait_current("/reports/generate", 2).await;
        }
    }
    wait_metric(
        &gw,
        "tollgate_queued{route=\"/reports/generate\"}",
        1.0,
        Duration::from_secs(10),
    )
    .await;
    // Two jobs on a route capped at 1: one runs, one is queued.
    for _ in 0..2 {
        let r = post(&c, gw.url("/jobs/run?delay_ms=60000"), "key-b").await;
        assert_eq!(r.status(), 202);
    }
    up.wait_current("/jobs/run", 1).await;
    eventually(Duration::from_secs(10), async || {
        let live = admin_get(&gw, "/admin/routes").await;
        let jobs = &route_entry(&live, "/jobs/run")["jobs"];
        (jobs["queued"] == 1 && jobs["running"] == 1)
            .then_some(())
            .ok_or(format!("jobs {jobs}"))
    })
    .await;
    // What the API says now (the page must say the same).
    let live = admin_get(&gw, "/admin/routes").await;
    let reports = route_entry(&live, "/reports/generate");
    assert_eq!(reports["cap"], 2, "{live}");
    assert_eq!(reports["running"], 2, "{live}");
    assert_eq!(reports["queued"], 1, "{live}");

    let url = format!("{}#token={TOKEN}", gw.admin("/admin/"));
    let page = url.clone();
    let dom = tokio::task::spawn_blocking(move || browse(&page, &["--dump-dom"]))
        .await
        .unwrap();
    let reports = "data-route=\"/reports/generate\"";
    assert_eq!(cell(&dom, reports, "cost"), "20");
    assert_eq!(cell(&dom, reports, "cap"), "2");
    assert_eq!(cell(&dom, reports, "running"), "2");
    assert_eq!(cell(&dom, reports, "queued"), "1");
    // Admitted when they got their slots, while they still run; b's waiter is not (yet).
    assert_eq!(cell(&dom, reports, "admitted"), "2");
    assert_eq!(cell(&dom, reports, "refused"), "0");
    for holder in [
        "<li data-key=\"a\" data-running=\"2\" data-waiting=\"0\">",
        "<li data-key=\"b\" data-running=\"0\" data-waiting=\"1\">",
    ] {
        assert!(dom.contains(holder), "no {holder} in the page:\n{dom}");
    }
    let exports = "data-route=\"/exports/bulk\"";
    assert_eq!(cell(&dom, exports, "admitted"), "1");
    assert_eq!(cell(&dom, exports, "refused"), "1");
    assert_eq!(cell(&dom, "<tr data-key=\"c\"", "refused"), "1");
    assert_eq!(text_of_id(&dom, "store-backend"), "redis");
    assert_eq!(text_of_id(&dom, "store-breaker"), "closed");
    assert_eq!(text_of_id(&dom, "store-fallback"), "off");
    assert_eq!(text_of_id(&dom, "store-on-error"), "local");
    assert!(
        dom.contains("120 / 1 min (silver-minute), 20000 / 1 d (silver-day)"),
        "{dom}"
    );
    // The async route's jobs, as /admin/routes gives them: 1 queued, 1 running.
    assert!(
        dom.contains(
            "<td class=\"route\">/jobs/run</td><td class=\"n\">1</td><td class=\"n\">1</td>"
        ),
        "{dom}"
    );
    assert!(!dom.contains("No async jobs."), "{dom}");
    assert!(!dom.contains(TOKEN), "the token is not in the page");

    let shot = artefact("status-page.png");
    let arg = format!("--screenshot={}", shot.display());
    let _ = std::fs::remove_file(&shot);
    tokio::task::spawn_blocking(move || browse(&url, &[arg.as_str(), "--window-size=1280,960"]))
        .await
        .unwrap();
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "screenshot {} is {size} bytes",
        shot.display()
    );
    println!("screenshot: {}", shot.display());
    for t in tasks {
        t.abort();
    }
}

/// While Redis is away the page still shows the store's health, breaker and fallback (from
/// `/admin/status`), and says that the fleet's route figures (`/admin/routes`, 503 then) are
/// unavailable, instead of giving up on the whole refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_page_shows_the_store_while_redis_is_away() {
    let mut redis = Redis::start();
    let up = Upstream::start(Duration::ZERO);
    let gw = on_redis(&redis, &up, "");
    let c = client();
    assert_eq!(get(&c, gw.url("/items"), "key-a").await.status(), 200);
    redis.kill();
    // A request on the fallback: the store is degraded from then on.
    assert_eq!(get(&c, gw.url("/items"), "key-a").await.status(), 200);
    wait_metric(&gw, "tollgate_store_degraded", 1.0, Duration::from_secs(10)).await;
    let r = client()
        .get(gw.admin("/admin/routes"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    let url = format!("{}#token={TOKEN}", gw.admin("/admin/"));
    let dom = tokio::task::spawn_blocking(move || browse(&url, &["--dump-dom"]))
        .await
        .unwrap();
    assert_eq!(text_of_id(&dom, "store-backend"), "redis");
    assert_eq!(text_of_id(&dom, "store-health"), "degraded");
    assert_eq!(text_of_id(&dom, "store-fallback"), "in force: local");
    assert_eq!(text_of_id(&dom, "store-on-error"), "local");
    let problem = text_of_id(&dom, "problem");
    assert!(problem.contains("/admin/routes: 503"), "{problem}");
    assert!(
        dom.contains("<table id=\"routes\" class=\"stale\">"),
        "{dom}"
    );
    assert_eq!(
        text_of_id(&dom, "updated").split(' ').next(),
        Some("partly")
    );
}

/// `/admin/routes` counts each route's admitted and refused requests of the last minute
/// exactly (every route, capped or not) and has an empty `jobs`; `/admin/status` names the
/// refused key, the plans and the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_routes_counts_the_last_minute_and_status_names_the_refused_keys() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &config());
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, gw.url("/items"), "key-a").await.status(), 200);
    }
    exports_of_key_c(&gw, 2).await;
    let start = Instant::now();
    let v = loop {
        let v = admin_json(&gw, "/admin/routes").await;
        let counts = |label| route_entry(&v, label)["last_minute"].clone();
        if counts("/items") == serde_json::json!({"admitted": 3, "refused": 0})
            && counts("/exports/bulk") == serde_json::json!({"admitted": 1, "refused": 2})
        {
            break v;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let reports = route_entry(&v, "/reports/generate");
    assert_eq!(reports["cost"], 20, "{v}");
    assert_eq!(reports["cap"], 2, "{v}");
    assert_eq!(reports["running"], 0, "{v}");
    assert_eq!(reports["queued"], 0, "{v}");
    assert_eq!(reports["keys"], serde_json::json!([]), "{v}");
    assert_eq!(
        reports["last_minute"],
        serde_json::json!({"admitted": 0, "refused": 0}),
        "{v}"
    );
    let default = route_entry(&v, "default");
    assert_eq!(default["cost"], 1, "{v}");
    assert!(default.get("cap").is_none(), "{v}");
    assert_eq!(
        v["jobs"],
        serde_json::json!([{"route": "/jobs/run", "queued": 0, "running": 0}]),
        "{v}"
    );
    assert_eq!(v["last_minute_seconds"], 60, "{v}");

    let s = admin_json(&gw, "/admin/status").await;
    assert_eq!(
        s["top_refused_keys"],
        serde_json::json!([{"key": "c", "refused": 2}]),
        "{s}"
    );
    assert_eq!(s["store"]["backend"], "memory", "{s}");
    assert_eq!(s["store"]["breaker"], serde_json::Value::Null, "{s}");
    assert_eq!(s["store"]["fallback"], "off", "{s}");
    assert_eq!(s["registry_keys"], 3, "{s}");
    let plans: Vec<&str> = s["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(plans, ["gold", "silver", "tiny"], "{s}");
    assert_eq!(s["plans"][0]["weight"], 2, "{s}");
    assert_eq!(s["plans"][0]["keys"], 2, "{s}");
    assert_eq!(
        s["plans"][1]["budgets"],
        serde_json::json!([
            {"name": "silver-minute", "max_cost": 120, "window_seconds": 60.0},
            {"name": "silver-day", "max_cost": 20000, "window_seconds": 86400.0}
        ]),
        "{s}"
    );
    assert_eq!(s["default"]["budgets"][0]["max_cost"], 1000, "{s}");
    assert_eq!(
        s["jobs"],
        serde_json::json!([{"route": "/jobs/run", "queued": 0, "running": 0}]),
        "{s}"
    );
}

/// With a token set: `/admin/` answers 401 with a sign-in page, the data 401; the token as
/// a Bearer credential at `/admin/session` gets a session cookie (HttpOnly, SameSite=Strict,
/// not the token) that opens the page and its data; the script and stylesheet need nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_the_page_and_a_session_cookie_opens_it() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &config(),
        env: vec![("TOLLGATE_ADMIN_TOKEN", TOKEN.to_string())],
        ..GatewayOpts::default()
    });
    let c = client();
    let r = c.get(gw.admin("/admin/")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("text/html; charset=utf-8")
    );
    let csp = header(&r, "content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(r.text().await.unwrap().contains("Admin token required"));
    for path in ["/admin/status", "/admin/routes"] {
        assert_eq!(c.get(gw.admin(path)).send().await.unwrap().status(), 401);
    }
    for path in ["/admin/status.js", "/admin/status.css"] {
        assert_eq!(c.get(gw.admin(path)).send().await.unwrap().status(), 200);
    }
    for wrong in [None, Some("not-the-admin-token-at-all")] {
        let mut req = c.get(gw.admin("/admin/session"));
        if let Some(t) = wrong {
            req = req.bearer_auth(t);
        }
        assert_eq!(req.send().await.unwrap().status(), 401);
    }
    let r = c
        .get(gw.admin("/admin/session"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let set = header(&r, "set-cookie").unwrap();
    assert!(set.starts_with("tollgate_admin="), "{set}");
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(!set.contains(TOKEN), "{set}");
    let cookie = set.split(';').next().unwrap().to_string();
    let page = c
        .get(gw.admin("/admin/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("data-page=\"status\""));
    let status = c
        .get(gw.admin("/admin/status"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(status.status(), 200);
    assert_eq!(
        admin_get(&gw, "/admin/routes").await["jobs"],
        serde_json::json!([{"route": "/jobs/run", "queued": 0, "running": 0}])
    );
}
