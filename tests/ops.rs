//! What SREs and the platform team rely on (DESIGN §2, §5): admin endpoints, metrics exactly as
//! named, access logs, reload, graceful shutdown, the CLI, and a real Prometheus scrape.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_and_token() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "store:\n  url: \"redis://:sekret-pw@127.0.0.1:1/0\"\nrate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 50}}\nplans:\n  pro: {{max_cost: 500, window: 1h}}\nkeys:\n  - {{id: acme, sha256: \"{}\", plan: pro}}\n",
        sha256_hex("acme-key")
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        env: vec![("TOLLGATE_ADMIN_TOKEN", "admintok-5e8a13c7b2f0".into())],
        ..GatewayOpts::default()
    });
    let c = client();
    assert_eq!(
        reqwest::get(gw.admin("/healthz")).await.unwrap().status(),
        200
    );
    let r = reqwest::get(gw.admin("/readyz")).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["store"], "ok");
    assert_eq!(
        reqwest::get(gw.admin("/metrics")).await.unwrap().status(),
        200
    );

    // /admin/* needs the token.
    assert_eq!(
        reqwest::get(gw.admin("/admin/config"))
            .await
            .unwrap()
            .status(),
        401
    );
    let r = c
        .get(gw.admin("/admin/config"))
        .header("Authorization", "Bearer wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let cfg = c
        .get(gw.admin("/admin/config"))
        .header("Authorization", "Bearer admintok-5e8a13c7b2f0")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(cfg.contains("redis://:***@127.0.0.1:1/0"), "{cfg}");
    assert!(!cfg.contains("sekret-pw"));
    assert!(cfg.contains("max_cost: 500"));
    // The edge settings show with DESIGN's defaults.
    assert!(cfg.contains("header_timeout: 10s") && cfg.contains("max_connections: 10000"));
    assert!(cfg.contains("forward_credentials: true"), "{cfg}");

    for _ in 0..3 {
        get(&c, gw.url("/items"), "acme-key").await;
    }
    let v: serde_json::Value = c
        .get(gw.admin("/admin/keys/acme"))
        .header("Authorization", "Bearer admintok-5e8a13c7b2f0")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["id"], "acme");
    assert_eq!(v["plan"], "pro");
    assert_eq!(v["limit"], 500);
    assert_eq!(v["remaining"], 497);
    let r = c
        .get(gw.admin("/admin/keys/nobody"))
        .header("Authorization", "Bearer admintok-5e8a13c7b2f0")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// Load balancers probe with HEAD: `/healthz` and `/readyz` answer it as they answer GET
/// (status, type, length), without a body; other methods are still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_on_healthz_and_readyz_answers_like_get() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 50}\n",
    );
    let c = client();
    for path in ["/healthz", "/readyz"] {
        let get = c.get(gw.admin(path)).send().await.unwrap();
        let head = c.head(gw.admin(path)).send().await.unwrap();
        assert_eq!(head.status(), 200, "HEAD {path}");
        for name in ["content-type", "content-length"] {
            assert_eq!(
                head.headers().get(name),
                get.headers().get(name),
                "{path} {name}"
            );
        }
        assert!(get.text().await.unwrap().len() > 1, "{path}");
        assert_eq!(head.text().await.unwrap(), "", "HEAD {path} has no body");
    }
    let post = c.post(gw.admin("/healthz")).send().await.unwrap();
    assert_eq!(post.status(), 405);
    assert_eq!(
        header(&post, "Allow").as_deref(),
        Some("GET, HEAD"),
        "405 says what is allowed"
    );
}

/// DESIGN §5: `tollgate_overhead_seconds` is the time in the gateway minus the upstream's part:
/// an upstream that takes 1.2 s to stream its body is not 1.2 s of gateway overhead. (Before,
/// the upstream's part ended at its response head, so the body's time counted as overhead.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_slow_body_is_not_gateway_overhead() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    // 4 frames of 64 KiB, one every 300 ms.
    let r = get(&c, gw.url("/bytes/262144?pace_ms=300"), "k-slow").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.unwrap().len(), 262_144);
    let series = |name: &str| format!("{name}{{route=\"default\"}}");
    // The request's metrics are recorded in its logging phase, just after the response: the
    // route's cost counter (there from the start, unlike the histograms) moves after them.
    assert_metric(&gw, &series("tollgate_cost_units_total"), 1.0).await;
    let total = metric(&gw, &series("tollgate_request_duration_seconds_sum")).await;
    let overhead = metric(&gw, &series("tollgate_overhead_seconds_sum")).await;
    assert!(total >= 1.2, "the request took {total} s");
    assert!(overhead < 0.3, "overhead {overhead} s of {total} s");
}

/// DESIGN §5: overhead is the time in the gateway minus the upstream's part and the waiting,
/// so never more than the request's whole time. A request never sent (a refunded 502: the
/// upstream refuses connections) measured its overhead as the time until its metrics were
/// written, after its duration was taken: larger, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overhead_is_never_more_than_the_requests_time() {
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("http://127.0.0.1:{}", free_port()),
        body: INCIDENT,
        ..GatewayOpts::default()
    });
    let c = client();
    for _ in 0..5 {
        assert_eq!(get(&c, gw.url("/items"), "k").await.status(), 502);
    }
    let series = |name: &str| format!("{name}{{route=\"default\"}}");
    wait_metric(
        &gw,
        &series("tollgate_overhead_seconds_count"),
        5.0,
        Duration::from_secs(5),
    )
    .await;
    let total = metric(&gw, &series("tollgate_request_duration_seconds_sum")).await;
    let overhead = metric(&gw, &series("tollgate_overhead_seconds_sum")).await;
    assert!(overhead <= total, "overhead {overhead} s of {total} s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_names_and_labels_exactly_as_designed() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{}keys:\n  - {{id: reg-1, sha256: \"{}\"}}\n",
        INCIDENT.replace(
            "      cost: 20\n",
            "      cost: 20\n      max_in_flight: 5\n"
        ),
        sha256_hex("k1")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    for _ in 0..7 {
        post(&c, gw.url("/reports/generate"), "k1").await;
    }
    c.get(gw.url("/items")).send().await.unwrap(); // 401
    get(&c, gw.url("/a%2fb"), "k1").await; // 400
    let expected = [
        "tollgate_requests_total{route=\"/reports/generate\",status=\"200\"} 6",
        "tollgate_requests_total{route=\"/reports/generate\",status=\"429\"} 1",
        "tollgate_rejections_total{reason=\"budget\",route=\"/reports/generate\"} 1",
        "tollgate_rejections_total{reason=\"unauthenticated\",route=\"default\"} 1",
        "tollgate_rejections_total{reason=\"bad_path\",route=\"default\"} 1",
        "tollgate_rejections_by_key_total{key=\"reg-1\"} 1",
        "tollgate_rejections_by_plan_total{plan=\"default\"} 1",
        "tollgate_cost_units_total{route=\"/reports/generate\"} 120",
        "tollgate_in_flight{route=\"/reports/generate\"} 0",
        "tollgate_in_flight_limit{route=\"/reports/generate\"} 5",
        "tollgate_request_duration_seconds_count{route=\"/reports/generate\"} 7",
        "tollgate_upstream_duration_seconds_count{route=\"/reports/generate\"} 6",
        "tollgate_queue_wait_seconds_count{route=\"/reports/generate\"} 6",
        "tollgate_request_duration_seconds_bucket{route=\"/reports/generate\",le=\"0.001\"}",
        "tollgate_request_duration_seconds_bucket{route=\"/reports/generate\",le=\"60\"} 7",
        "tollgate_store_degraded 0",
        "tollgate_config_reloads_total{result=\"ok\"} 0",
        "tollgate_config_reloads_total{result=\"error\"} 0",
        "tollgate_store_calls_total{result=\"breaker_open\"} 0",
        "tollgate_store_duration_seconds_count 0",
    ];
    // Metrics are recorded just after each response is sent: give the last one a moment.
    let start = Instant::now();
    let text = loop {
        let text = admin_text(&gw, "/metrics").await;
        let missing: Vec<&&str> = expected
            .iter()
            .filter(|e| !text.lines().any(|l| l.starts_with(**e)))
            .collect();
        if missing.is_empty() {
            break text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "missing {missing:?} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // No raw path or key ever becomes a label.
    assert!(!text.contains("a%2fb") && !text.contains("\"k1\""));
    // Every exported tollgate metric is one of the designed names.
    let exported: BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("# TYPE tollgate_"))
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    let designed: BTreeSet<&str> = tollgate::telemetry::METRIC_NAMES
        .iter()
        .copied()
        // Series of these exist only for routes configured for them (`mode: shadow`,
        // `cost_from_response`, `async`), or with `tracing:`, and this config has none.
        .filter(|n| {
            ![
                "tollgate_shadow_rejections_total",
                "tollgate_cost_reports_total",
                "tollgate_jobs_total",
                "tollgate_jobs",
                "tollgate_trace_spans_dropped_total",
            ]
            .contains(n)
        })
        .collect();
    assert_eq!(exported, designed);
    // The standard process metrics (DESIGN §5: cpu, rss, fds), with this process's figures.
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name}"))
    };
    assert!(value("process_cpu_seconds_total") > 0.0);
    let rss = value("process_resident_memory_bytes");
    assert!((1e6..1e9).contains(&rss), "rss {rss}");
    let fds = value("process_open_fds");
    assert!((5.0..1000.0).contains(&fds), "fds {fds}");
    assert!(value("process_max_fds") >= fds);
}

/// The dashboard and the alert rules against what the real binary exports, both ways:
/// `deploy/check.sh --metrics` starts this build's `tollgate run`, sends it a few requests,
/// scrapes /metrics and compares (its PENDING allow-list names the DESIGN §5 metrics that are
/// still being added).
#[test]
fn dashboard_and_alerts_match_the_exported_metrics() {
    let out = Command::new("bash")
        .args(["deploy/check.sh", "--metrics"])
        .env("TOLLGATE_BIN", env!("CARGO_BIN_EXE_tollgate"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_has_the_fields_and_no_keys() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    post(&c, gw.url("/reports/generate"), "super-secret-key").await;
    let e = gw
        .wait_access(1, |e| e["route"] == "/reports/generate")
        .await
        .remove(0);
    assert_eq!(e["decision"], "admitted");
    assert_eq!(e["status"], 200);
    assert_eq!(e["cost"], 20);
    assert_eq!(e["method"], "POST");
    let key = e["key"].as_str().unwrap();
    assert!(key.starts_with("key:") && key.len() == 12, "{key}");
    for f in [
        "latency_ms",
        "upstream_ms",
        "store_ms",
        "queue_ms",
        "hold_ms",
    ] {
        assert!(e[f].as_f64().is_some(), "{f} in {e}");
    }
    assert_eq!(e["upstream_status"], 200);
    assert_eq!(e["client"], "127.0.0.1");
    assert_eq!(e["fallback"], false);
    // A request id is made up when the client sends none, and is what the upstream received.
    let id = e["request_id"].as_str().unwrap().to_string();
    assert!(
        id.len() == 32
            && id
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "32 lower-case hex digits: {id}"
    );
    let seen = up.api.seen();
    let sent = seen
        .iter()
        .find(|s| s.target == "/reports/generate")
        .unwrap();
    assert_eq!(sent.header("x-request-id"), vec![id.as_str()]);
    // The client's own id is kept, forwarded and logged.
    c.get(gw.url("/items/1"))
        .header("X-API-Key", "k")
        .header("X-Request-Id", "abc-123")
        .send()
        .await
        .unwrap();
    gw.wait_access(1, |e| e["request_id"] == "abc-123").await;
    let last = up.api.seen();
    assert_eq!(last.last().unwrap().header("x-request-id"), vec!["abc-123"]);
    assert!(!gw.log().contains("super-secret-key"));
    // Pingora's own `log` records come through the same subscriber.
    gw.wait_log("\"target\":\"pingora_core::server\"").await;
}

/// Raw keys stay out of the log at every `RUST_LOG` level: Pingora's debug and trace records
/// print request heads whole (`"x-api-key": "…"`, `authorization: Bearer …`), so they are
/// not logged (tollgate's own debug events still are).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_logging_never_writes_a_raw_key() {
    let up = Upstream::start(Duration::ZERO);
    let c = client();
    for rust_log in ["debug", "trace"] {
        let mut gw = Gateway::start_opts(GatewayOpts {
            upstream_url: up.url(),
            body: "identity:\n  sources: [\"header:x-api-key\", bearer]\nrate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
            env: vec![("RUST_LOG", rust_log.to_string())],
            ..GatewayOpts::default()
        });
        assert_eq!(
            get(&c, gw.url("/items/1"), "raw-key-in-a-header")
                .await
                .status(),
            200
        );
        let r = c
            .get(gw.url("/items/2"))
            .header("Authorization", "Bearer raw-key-as-a-bearer")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        gw.signal("TERM");
        assert_eq!(gw.wait_exit(Duration::from_secs(12)), Some(0), "{rust_log}");
        let log = gw.log();
        assert_eq!(gw.access_log().len(), 2, "{rust_log}");
        for raw in ["raw-key-in-a-header", "raw-key-as-a-bearer"] {
            assert!(!log.contains(raw), "{rust_log}: {raw} logged");
        }
    }
}

/// `RUST_LOG` decides whether there is an access log, as it did when the line was a tracing
/// event: `info` on, `warn` off, and the `tollgate::access` target on or off by itself. Counted
/// after a graceful exit, which writes out every queued line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_turns_the_access_log_on_and_off() {
    let up = Upstream::start(Duration::ZERO);
    let c = client();
    for (rust_log, lines, info) in [
        ("info", 3, true),
        ("warn", 0, false),
        ("info,tollgate::access=off", 0, true),
        ("warn,tollgate::access=info", 3, false),
    ] {
        let mut gw = Gateway::start_opts(GatewayOpts {
            upstream_url: up.url(),
            body: "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
            env: vec![("RUST_LOG", rust_log.to_string())],
            ..GatewayOpts::default()
        });
        for _ in 0..3 {
            assert_eq!(get(&c, gw.url("/items/1"), "k").await.status(), 200);
        }
        gw.signal("TERM");
        assert_eq!(gw.wait_exit(Duration::from_secs(12)), Some(0), "{rust_log}");
        assert_eq!(gw.access_log().len(), lines, "{rust_log}:\n{}", gw.log());
        assert_eq!(gw.log().contains("drained; exiting"), info, "{rust_log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reload_valid_and_invalid() {
    let up = Upstream::start(Duration::ZERO);
    let limits = |items_cost: &str| {
        format!("rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n  endpoints:\n    /items: {{cost: {items_cost}}}\n")
    };
    let gw = Gateway::start(&up, &limits("1"));
    let c = client();
    let call = || async {
        let r = get(&c, gw.url("/items"), "k").await;
        (
            header(&r, "X-RateLimit-Cost").unwrap(),
            header(&r, "X-RateLimit-Remaining").unwrap(),
        )
    };
    assert_eq!(call().await, ("1".into(), "99".into()));
    // The build, and the running file by its hash (the first 8 bytes of its SHA-256), each a
    // series of value 1; when it was loaded (DESIGN §5).
    let version = env!("CARGO_PKG_VERSION");
    assert_metric(
        &gw,
        &format!("tollgate_build_info{{version=\"{version}\"}}"),
        1.0,
    )
    .await;
    let config_info = || async {
        let text = admin_text(&gw, "/metrics").await;
        let series: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("tollgate_config_info{"))
            .map(str::to_string)
            .collect();
        series
    };
    let hash_of_file = || {
        let text = std::fs::read(&gw.config_path).unwrap();
        hex::encode(tollgate::identity::hash_key(&text))[..16].to_string()
    };
    assert_eq!(
        config_info().await,
        [format!(
            "tollgate_config_info{{hash=\"{}\"}} 1",
            hash_of_file()
        )]
    );
    const LOADED: &str = "tollgate_config_last_reload_timestamp_seconds";
    let loaded = metric(&gw, LOADED).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(loaded <= now && loaded > now - 60.0, "{loaded} at {now}");

    // A valid change takes effect for new requests; the budget carries over.
    gw.edit_config("cost: 1}", "cost: 7}");
    gw.signal("HUP");
    let start = Instant::now();
    // Polls answered before the reload lands are charged the old cost, 1 each.
    let mut at_old_cost = 0;
    loop {
        let (cost, remaining) = call().await;
        if cost == "7" {
            let carried_over = (99 - at_old_cost - 7).to_string();
            assert_eq!(remaining, carried_over, "{at_old_cost} polls at cost 1");
            break;
        }
        at_old_cost += 1;
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "reload not applied"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_metric(&gw, "tollgate_config_reloads_total{result=\"ok\"}", 1.0).await;
    // One series still, the new file's; loaded later than the first.
    assert_eq!(
        config_info().await,
        [format!(
            "tollgate_config_info{{hash=\"{}\"}} 1",
            hash_of_file()
        )]
    );
    assert!(metric(&gw, LOADED).await > loaded);

    // An invalid file is refused, logged with its field path, and the old config stays.
    gw.edit_config("cost: 7}", "cost: 0}");
    gw.signal("HUP");
    wait_metric_at_least(&gw, "tollgate_config_reloads_total{result=\"error\"}", 1.0).await;
    assert_eq!(call().await.0, "7");
    gw.wait_log("rate_limits.endpoints.\\\"/items\\\".cost: must be a positive integer, got 0")
        .await;
}

/// A reload that changes settings read only at start (`server.threads`, `grace_period`,
/// `store.*`…) keeps their running values, says so for each, and `/admin/config` shows what is
/// in force; the rest of the file takes effect (before, the reload was silent about the
/// server's settings and `/admin/config` showed values that were not in force).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_what_only_a_restart_changes_and_says_so() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        "store:\n  fleet_size: 2\nrate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
    );
    let config = || async {
        reqwest::get(gw.admin("/admin/config"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // The values the gateway started with.
    let started = |yaml: &str| {
        ["threads: 2", "grace_period: 2s", "fleet_size: 2"]
            .iter()
            .all(|v| yaml.contains(v))
    };
    let before = config().await;
    assert!(started(&before), "{before}");
    gw.edit_config("threads: 2", "threads: 3");
    gw.edit_config("grace_period: 2s", "grace_period: 5s");
    gw.edit_config("fleet_size: 2", "fleet_size: 3");
    gw.edit_config("cost: 1,", "cost: 4,");
    gw.reload(0.0).await;
    let r = get(&client(), gw.url("/items"), "k").await;
    assert_eq!(
        header(&r, "X-RateLimit-Cost").as_deref(),
        Some("4"),
        "the rest took effect"
    );
    let after = config().await;
    assert!(started(&after), "{after}");
    assert!(after.contains("cost: 4"), "{after}");
    for field in ["server.threads", "server.grace_period", "store.fleet_size"] {
        gw.wait_log(&format!("{field} takes effect on restart only"))
            .await;
    }
}

/// An upstream that reads each request's head, records its target and never answers: a
/// health check of it fails only at the check's read timeout (1 s).
struct Silent {
    port: u16,
    targets: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Silent {
    async fn start() -> Silent {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let targets = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
        let seen = targets.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut head = vec![];
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&head)
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_string();
                    let target = line.split(' ').nth(1).unwrap_or("").to_string();
                    seen.lock().unwrap().push(target);
                    // Hold the connection until the peer gives up.
                    while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        Silent { port, targets }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn count(&self, health: bool) -> usize {
        let t = self.targets.lock().unwrap();
        t.iter()
            .filter(|t| (t.as_str() == "/healthz") == health)
            .count()
    }
}

/// A pool of a silent address and a live one, health-checked every `interval`.
fn checked_pool(silent: &Silent, up: &Upstream, interval: &str) -> String {
    format!(
        "upstreams:\n  pool:\n    urls: [\"{}\", \"{}\"]\n    read_timeout: 1s\n    health_check: {{ path: /healthz, interval: {interval} }}\nrate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n    \"/svc/{{*rest}}\": {{upstream: pool, strip_prefix: /svc}}\n",
        silent.url(),
        up.url()
    )
}

/// An address the health check found down stays skipped across a reload that leaves it as
/// it was: the new config's pool does not start it out as healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_health_of_unchanged_addresses() {
    let up = Upstream::start(Duration::ZERO);
    let silent = Silent::start().await;
    let gw = Gateway::start(&up, &checked_pool(&silent, &up, "200ms"));
    let c = client();
    // The second check of the silent address starts after the first pass has marked it down.
    let start = Instant::now();
    while silent.count(true) < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "no health check");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..4 {
        assert_eq!(get(&c, gw.url("/svc/items"), "k").await.status(), 200);
    }
    gw.reload(0.0).await;
    for i in 0..6 {
        let r = get(&c, gw.url("/svc/items"), "k").await;
        assert_eq!(r.status(), 200, "request {i} after the reload");
    }
    assert_eq!(
        silent.count(false),
        0,
        "no request reached the down address"
    );
}

/// The gateway's threads and open files (Linux /proc).
fn threads_and_fds(pid: u32) -> (usize, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (threads, fds)
}

/// 50 reloads, each changing the pool's health check (so each starts a checker of its own):
/// the checkers of the configs replaced stop at once, and threads and fds stay flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_with_a_health_checked_pool_leave_no_threads_behind() {
    let up = Upstream::start(Duration::ZERO);
    let silent = Silent::start().await;
    let gw = Gateway::start(&up, &checked_pool(&silent, &up, "30s"));
    let start = Instant::now();
    while up.count("/healthz") == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no health check");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = threads_and_fds(gw.pid());
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    for i in 0..50 {
        let interval = if i % 2 == 0 { "31s" } else { "30s" };
        std::fs::write(
            &gw.config_path,
            text.replace("interval: 30s", &format!("interval: {interval}")),
        )
        .unwrap();
        gw.reload(i as f64).await;
    }
    // A replaced checker that lived on would last its 30 s interval; a stopped one is gone
    // within its check's timeout (1 s).
    let start = Instant::now();
    let mut after = threads_and_fds(gw.pid());
    while after.0 > before.0 + 3 || after.1 > before.1 + 3 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "threads, fds before {before:?}, after 50 reloads {after:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = threads_and_fds(gw.pid());
    }
    eprintln!("threads, fds before {before:?}, after 50 reloads {after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_reloads_a_changed_file() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
        args: vec!["--watch"],
        ..GatewayOpts::default()
    });
    gw.edit_config("{cost: 1,", "{cost: 3,");
    let c = client();
    let start = Instant::now();
    loop {
        let r = get(&c, gw.url("/items"), "k").await;
        if header(&r, "X-RateLimit-Cost").as_deref() == Some("3") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "change not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_request_and_exits_zero() {
    let up = Upstream::start(Duration::from_millis(1500));
    let mut gw = Gateway::start_with_grace(&up, "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 1}\n", "10s");
    let c = client();
    let slow = spawn_post(&c, gw.url("/reports/generate"), "k");
    up.wait_current("/reports/generate", 1).await;
    let t = Instant::now();
    gw.signal("TERM");
    // Polled until SIGTERM is handled (ready until then), not slept on: an answer other
    // than 200 comes while the request is still in flight (1.5 s), or the process is gone.
    let ready = loop {
        let ready = reqwest::get(gw.admin("/readyz"))
            .await
            .map(|r| r.status().as_u16());
        if ready.as_ref().ok() != Some(&200) {
            break ready;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ready.ok(), Some(503), "not ready while draining");
    assert_eq!(slow.await.unwrap(), 200, "the in-flight request finished");
    let code = gw.wait_exit(Duration::from_secs(12));
    assert_eq!(code, Some(0));
    let took = t.elapsed();
    // It left once the request was done, not after the whole 10 s grace period.
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(gw.log().contains("drained; exiting"));
}

/// DESIGN §5's one access-log event per request, for a request still running when the grace
/// period ends: it is cut off (its upstream connection shut down), answered 502 (charged: the
/// upstream had it), logged, and not sent again (a GET: idempotent, but the upstream had it);
/// one whose answer is under way has its connection closed, and is logged too.
/// Before, the exit ended it with the process: its client's connection closed unanswered, and
/// no line was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_running_when_the_grace_period_ends_is_answered_and_logged() {
    let up = Upstream::start(Duration::from_secs(30));
    let body = "rate_limits:\n  default: {cost: 2, window: 1h, max_cost: 100}\n";
    let mut gw = Gateway::start_with_grace(&up, body, "1s");
    // One whose answer is under way (its head received; 64 KiB every 200 ms of 100 MB).
    let c = client();
    let streaming = c
        .get(gw.url("/bytes/100000000?pace_ms=200"))
        .header("X-API-Key", "k")
        .send()
        .await
        .unwrap();
    assert_eq!(streaming.status(), 200);
    let (c, url) = (client(), gw.url("/slow?delay_ms=30000"));
    let slow = tokio::spawn(async move { c.get(url).header("X-API-Key", "k").send().await });
    up.wait_current("/slow", 1).await;
    let t = Instant::now();
    gw.signal("TERM");
    let r = slow
        .await
        .unwrap()
        .expect("an answer, not a closed connection");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(r.status(), 502);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("2"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("96"));
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(
        p["detail"].as_str().unwrap().contains("grace period"),
        "{p}"
    );
    // The answer under way is cut short: its connection closes.
    assert!(
        streaming.bytes().await.is_err(),
        "the stream ran to its end"
    );
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
    // Each has its line, charged: the 502, and the answer cut short (its status, and why).
    let lines = gw.access_log();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let line = |status: u64| {
        let of: Vec<_> = lines.iter().filter(|l| l["status"] == status).collect();
        assert_eq!(of.len(), 1, "{status}: {lines:?}");
        of[0].clone()
    };
    assert_eq!(line(502)["cost"], 2, "{lines:?}");
    let cut_short = line(200);
    assert_eq!(cut_short["cost"], 2, "{lines:?}");
    assert!(cut_short["error"].is_string(), "{cut_short}");
    assert_eq!(up.count("/slow"), 1, "sent once");
}

/// Issue 22's "SIGINT worker spin": SIGINT with requests running, queued for a capped route's
/// slot and held by `max_delay` exits 0 at once (it does not drain), after giving back what
/// it holds and answering what it queued or held, and no thread spins on the way out. (Pingora's own fast shutdown joins each
/// worker thread without a bound, and a worker reads the shutdown only when its runtime comes
/// back to it; tollgate's SIGINT path never goes there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_with_work_in_every_state_exits_zero_at_once() {
    let up = Upstream::start(Duration::from_secs(30));
    let mut gw = Gateway::start_with_grace(&up, "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /reports/generate: {cost: 1, max_in_flight: 2, queue_timeout: 60s}\n    /held: {shared: {max_cost: 1, window: 20s, max_delay: 60s}}\n", "30s");
    let c = client();
    let mut pending = vec![];
    for _ in 0..6 {
        let (c, url) = (c.clone(), gw.url("/reports/generate"));
        pending.push(tokio::spawn(async move {
            let r = c.post(url).header("X-API-Key", "k").send().await;
            r.map(|r| r.status().as_u16()).ok()
        }));
    }
    let mut held = vec![];
    for _ in 0..3 {
        let (c, url) = (c.clone(), gw.url("/held?delay_ms=30000"));
        held.push(tokio::spawn(async move {
            let r = c.get(url).header("X-API-Key", "h").send().await;
            r.map(|r| r.status().as_u16()).ok()
        }));
    }
    up.wait_current("/reports/generate", 2).await;
    wait_metric(
        &gw,
        "tollgate_queued{route=\"/reports/generate\"}",
        4.0,
        Duration::from_secs(10),
    )
    .await;
    up.wait_current("/held", 1).await;
    wait_metric(
        &gw,
        "tollgate_in_flight{route=\"/held\"}",
        3.0,
        Duration::from_secs(10),
    )
    .await;
    let t = Instant::now();
    gw.signal("INT");
    let code = gw.wait_exit(Duration::from_secs(5));
    let took = t.elapsed();
    assert_eq!(code, Some(0), "exit code");
    assert!(took < Duration::from_secs(2), "SIGINT took {took:?}");
    // The two running are cut off (SIGINT does not drain) and answered 502, charged; the
    // four queued for a slot leave the queue (their charges back) and are answered 503.
    let mut answers = vec![];
    for p in pending {
        answers.push(p.await.unwrap());
    }
    answers.sort();
    assert_eq!(
        answers,
        [
            Some(502),
            Some(502),
            Some(503),
            Some(503),
            Some(503),
            Some(503)
        ]
    );
    // The first went (cut off: 502); the two held for their turn got their reservations back
    // and a 503.
    let mut answers = vec![];
    for h in held {
        answers.push(h.await.unwrap());
    }
    answers.sort();
    assert_eq!(answers, [Some(502), Some(503), Some(503)]);
}

fn tollgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `--log-format pretty` (the default): one access-log line per request with the route, the
/// key's id (never the key), the cost, the decision and the status, and — written to a file,
/// not a terminal — no colour escape codes (they were written into files as text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pretty_log_names_the_key_by_its_id_and_writes_no_escape_codes_to_a_file() {
    let up = Upstream::start(Duration::ZERO);
    let raw = "pretty-log-secret-key-0123456789";
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &format!(
            "rate_limits:\n  default: {{cost: 3, window: 1h, max_cost: 5}}\nkeys:\n  - {{id: pretty-id, sha256: \"{}\"}}\n",
            sha256_hex(raw)
        ),
        log_format: "pretty",
        // Not colourless by the environment's say (NO_COLOR set in CI): by the file.
        env: vec![("NO_COLOR", String::new())],
        ..GatewayOpts::default()
    });
    let c = client();
    assert_eq!(get(&c, gw.url("/items?q=1"), raw).await.status(), 200);
    assert_eq!(get(&c, gw.url("/items?q=2"), raw).await.status(), 429);
    let lines = eventually(Duration::from_secs(5), async || {
        let log = gw.log();
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains("tollgate::access"))
            .map(str::to_string)
            .collect();
        (lines.len() == 2).then_some(lines).ok_or(log)
    })
    .await;
    for (line, cost, decision, status) in [
        (&lines[0], 3, "admitted", 200),
        (&lines[1], 0, "budget", 429),
    ] {
        for field in [
            "route=\"default\"".to_string(),
            "key=\"pretty-id\"".to_string(),
            format!("cost={cost} "),
            format!("decision=\"{decision}\""),
            format!("status={status} "),
        ] {
            assert!(line.contains(&field), "no {field} in {line}");
        }
    }
    let log = gw.log();
    assert!(!log.contains(raw), "the raw key is in the log");
    assert!(!log.contains('\u{1b}'), "escape codes in a log file");
}

/// `server.listen` as a list (DESIGN §1: "string or list"): the gateway serves on every
/// address, one budget for them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_list_serves_on_every_address() {
    let up = Upstream::start(Duration::ZERO);
    let second = free_port();
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 10}\n",
        also_listen: Some(second),
        ..GatewayOpts::default()
    });
    let c = client();
    let urls = [gw.url("/items"), format!("http://127.0.0.1:{second}/items")];
    for (i, url) in urls.iter().cycle().take(4).enumerate() {
        let r = get(&c, url, "k").await;
        assert_eq!(r.status(), 200, "{url}");
        let left = (9 - i).to_string();
        assert_eq!(
            header(&r, "X-RateLimit-Remaining").as_deref(),
            Some(left.as_str())
        );
    }
    assert_eq!(up.count("/items"), 4);
}

/// Without `-c`, the commands read `./gateway.yaml` (DESIGN §2): `check` passes in a directory
/// that has one and fails, naming the file, in one that has none.
#[test]
fn the_default_config_is_gateway_yaml_in_the_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let (code, text) = run(&["check"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("gateway.yaml"), "{text}");
    std::fs::copy("gateway.yaml", dir.path().join("gateway.yaml")).unwrap();
    let (code, text) = run(&["check"]);
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = run(&["explain", "POST", "/reports/generate"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("/reports/generate"), "{text}");
}

#[test]
fn cli_check_and_explain() {
    let (code, out, _) = tollgate(&["check", "-c", "gateway.yaml"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("/reports/generate  20    5              2s"),
        "{out}"
    );
    assert!(out.contains("gateway.yaml: ok"));

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string("gateway.yaml").unwrap();
    std::fs::write(
        &bad,
        text.replace("cost: 20", "cost: 0")
            .replace("max_cost: 600", "max_cost: 600\n    color: blue"),
    )
    .unwrap();
    let (code, _, err) = tollgate(&["check", "-c", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("plans.enterprise.color: unknown field `color`"),
        "{err}"
    );

    std::fs::write(&bad, text.replace("cost: 20", "cost: 0")).unwrap();
    let (code, _, err) = tollgate(&["check", "-c", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(
        err.lines().next().unwrap(),
        "rate_limits.endpoints.\"/reports/generate\".cost: must be a positive integer, got 0"
    );

    let (code, out, _) = tollgate(&[
        "explain",
        "-c",
        "gateway.yaml",
        "POST",
        "/reports/./generate",
        "--key",
        "abc",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("route:        /reports/generate") && out.contains("cost:         20"),
        "{out}"
    );
    assert!(!out.contains("abc"), "the key is never printed");
    let (code, out, _) = tollgate(&["explain", "-c", "gateway.yaml", "GET", "/a%2Fb"]);
    assert_eq!(code, 1);
    assert!(out.contains("400 bad-path"));
}

/// Each config that `run` could not honour (DESIGN §1 rules), as `check` reports it: exit 1,
/// the first line of stderr names the field, and no panic whatever the input.
/// Unknown keys do not hide the file's other errors: every one is reported, each with its
/// field path, unknown keys in several sections included.
#[test]
fn check_reports_every_unknown_key_and_every_other_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "server:\n  listn: \"127.0.0.1:8080\"\nupstream:\n  url: \"http://127.0.0.1:3000\"\nstore:\n  fleetsize: 2\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n  endpoints:\n    /reports/generate: {cost: 0}\n    /exports/bulk: {cost: 500}\n",
    )
    .unwrap();
    let (code, out, err) = tollgate(&["check", "-c", bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 5, "{err}");
    assert!(
        lines[0].starts_with("server.listn: unknown field `listn`, expected one of `listen`"),
        "{err}"
    );
    assert!(
        lines[1].starts_with("store.fleetsize: unknown field `fleetsize`, expected one of"),
        "{err}"
    );
    assert_eq!(
        lines[2],
        "rate_limits.endpoints.\"/exports/bulk\".cost: cost 500 exceeds rate_limits.default.max_cost 120: such a request could never pass"
    );
    assert_eq!(
        lines[3],
        "rate_limits.endpoints.\"/reports/generate\".cost: must be a positive integer, got 0"
    );
    assert!(lines[4].ends_with("bad.yaml: 4 error(s)"), "{err}");

    // 150 endpoints that cost more than the budget: the first 100 errors, then how many more
    // (README: "up to 100"; all 150 were printed).
    let endpoints: String = (0..150)
        .map(|i| format!("    /e{i:03}: {{cost: 500}}\n"))
        .collect();
    std::fs::write(
        &bad,
        format!("upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n  default: {{cost: 1, window: 60s, max_cost: 120}}\n  endpoints:\n{endpoints}"),
    )
    .unwrap();
    let (code, out, err) = tollgate(&["check", "-c", bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 102, "{err}");
    assert!(
        lines[99].starts_with("rate_limits.endpoints.\"/e099\".cost: cost 500"),
        "{err}"
    );
    assert_eq!(lines[100], "… and 50 more");
    assert!(lines[101].ends_with("bad.yaml: 150 error(s)"), "{err}");
}

#[test]
fn check_refuses_what_run_cannot_honour() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string("gateway.yaml").unwrap();
    let redis = |url: &str| {
        text.replace("backend: memory", "backend: redis")
            .replace("\"redis://127.0.0.1:6379/0\"", &format!("\"{url}\""))
    };
    let long = "a".repeat(70_000);
    let cases: Vec<(&str, String, &str)> = vec![
        ("bad db", redis("redis://127.0.0.1:6379/abc"), "store.url: "),
        ("bad host", redis("redis://[::1"), "store.url: "),
        ("bad port", redis("redis://:99999"), "store.url: "),
        (
            "sentinel without a master name",
            redis("redis+sentinel://h1:26379,h2:26379"),
            "store.url: ",
        ),
        (
            "endpoint twice",
            text.replace(
                "    /analytics/query:\n",
                "    /exports/bulk:\n      cost: 2\n    /analytics/query:\n",
            ),
            "rate_limits.endpoints.\"/exports/bulk\": appears twice",
        ),
        (
            "plan twice",
            text.replace(
                "plans:\n",
                "plans:\n  enterprise: {max_cost: 5, window: 1s}\n",
            ),
            "plans.enterprise: appears twice",
        ),
        (
            "upstream twice",
            format!(
                "{text}upstreams:\n  reports: {{url: \"http://127.0.0.1:3001\"}}\n  reports: {{url: \"http://127.0.0.1:3002\"}}\n"
            ),
            "upstreams.reports: appears twice",
        ),
        (
            "not normalized",
            text.replace("    /exports/bulk:", "    /exports/%62ulk:"),
            "rate_limits.endpoints.\"/exports/%62ulk\": ",
        ),
        (
            "never matches",
            text.replace("    /exports/bulk:", "    /exports%2Fbulk:"),
            "rate_limits.endpoints.\"/exports%2Fbulk\": ",
        ),
        (
            "long plan name",
            text.replace("  enterprise:\n", &format!("  ? {long}\n  :\n")),
            "plans.\"aaaa",
        ),
        (
            "long pattern",
            text.replace("    /exports/bulk:\n", &format!("    ? /{long}\n    :\n")),
            "rate_limits.endpoints.\"/aaaa",
        ),
        (
            "deep nesting",
            "[".repeat(100_000),
            ".: nested deeper than 64 levels",
        ),
    ];
    for (name, body, expected) in cases {
        let f = dir.path().join("bad.yaml");
        std::fs::write(&f, &body).unwrap();
        let t = Instant::now();
        let (code, _, err) = tollgate(&["check", "-c", f.to_str().unwrap()]);
        assert_eq!(code, 1, "{name}: {err}");
        assert!(
            err.starts_with(expected),
            "{name}: {}",
            &err[..err.len().min(300)]
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{name}: {:?}",
            t.elapsed()
        );
    }

    // TOLLGATE_REDIS_URL is checked like the file's value, and its password never shown.
    let f = dir.path().join("redis.yaml");
    std::fs::write(&f, text.replace("backend: memory", "backend: redis")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "-c", f.to_str().unwrap()])
        .env("TOLLGATE_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/abc")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("store.url: ") && err.contains("TOLLGATE_REDIS_URL"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
}

/// `tollgate check | head -1`: a reader that goes away is not a crash.
#[test]
fn check_with_a_closed_stdout_exits_quietly() {
    for args in [
        vec!["check", "-c", "gateway.yaml"],
        vec!["explain", "-c", "gateway.yaml", "GET", "/reports/1"],
    ] {
        // The read end is closed before the child writes anything: every write is EPIPE.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(&args)
            .stdout(writer)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
    // And through a real shell pipeline.
    let out = Command::new("bash")
        .args([
            "-c",
            &format!(
                "set -o pipefail; {} check -c gateway.yaml | head -1",
                env!("CARGO_BIN_EXE_tollgate")
            ),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_shows_a_503_and_a_429() {
    let (port, admin, upstream) = (free_port(), free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "demo",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--upstream-listen",
            &format!("127.0.0.1:{upstream}"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = Reap(child);
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(15));
        std::thread::sleep(Duration::from_millis(50));
    }
    let c = client();
    let url = format!("http://127.0.0.1:{port}/reports/generate");
    // The README's session: 8 reports at once, twice, then another key.
    let batch = || async {
        sorted_statuses(&all_at_once(8, |_| c.post(&url).header("X-API-Key", "demo-key")).await)
    };
    // 5 run; the 6th is charged as it joins the queue (120 of 120 units), so the 7th and
    // 8th are refused by the budget at once (DESIGN §8); the 6th finds no slot within 1 s
    // (503, refunded).
    assert_eq!(batch().await, vec![200, 200, 200, 200, 200, 429, 429, 503]);
    assert_eq!(batch().await, vec![200, 429, 429, 429, 429, 429, 429, 429]);
    let r = get(&c, format!("http://127.0.0.1:{port}/items/42"), "other-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("119"));

    // The config file the demo wrote goes when it exits.
    let config = std::env::temp_dir().join(format!("tollgate-demo-{}.yaml", child.0.id()));
    assert!(config.exists(), "{config:?}");
    let pid = child.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    while child.0.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the demo did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!config.exists(), "{config:?} was left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_429s() {
    if Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("prometheus must be installed (apt-get install prometheus)");
    }
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    let mut rejected = 0;
    for _ in 0..10 {
        let r = post(&c, gw.url("/reports/generate"), "k").await;
        if r.status() == 429 {
            rejected += 1;
        }
    }
    assert_eq!(rejected, 4);

    let dir = tempfile::tempdir().unwrap();
    let prom_port = free_port();
    std::fs::write(
        dir.path().join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tollgate\n    static_configs:\n      - targets: [\"127.0.0.1:{}\"]\n",
            gw.admin_port
        ),
    )
    .unwrap();
    let prom = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _prom = Reap(prom);
    let query = format!(
        "http://127.0.0.1:{prom_port}/api/v1/query?query=sum(tollgate_rejections_total%7Breason%3D%22budget%22%7D)"
    );
    let start = Instant::now();
    let value = loop {
        if let Ok(r) = reqwest::get(&query).await {
            if let Ok(v) = r.json::<serde_json::Value>().await {
                if let Some(s) = v["data"]["result"][0]["value"][1].as_str() {
                    break s.to_string();
                }
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "prometheus never saw the metric"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(value, "4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_slots_survive_a_reload() {
    let up = Upstream::start(Duration::from_millis(1500));
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /items: {cost: 1}\n    /reports/generate: {cost: 1, max_in_flight: 1}\n",
    );
    let c = client();
    let slow = spawn_post(&c, gw.url("/reports/generate"), "a");
    up.wait_current("/reports/generate", 1).await;
    // Reload with another route's cost changed; the report route's one slot is still taken.
    gw.edit_config("/items: {cost: 1}", "/items: {cost: 2}");
    gw.signal("HUP");
    let start = Instant::now();
    while header(&get(&c, gw.url("/items"), "b").await, "X-RateLimit-Cost").as_deref() != Some("2")
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "reload not applied"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = post(&c, gw.url("/reports/generate?delay_ms=1"), "b").await;
    assert_eq!(
        r.status(),
        503,
        "the in-flight count carried over the reload"
    );
    assert_eq!(slow.await.unwrap(), 200);
}

/// A reload that changes a capped route's `max_in_flight` (memory store) keeps counting the
/// requests already running: three run on a cap of 3, the cap becomes 2, and a new request
/// is refused until they end. (The route's count started again from zero: two more ran, five
/// at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_slots_survive_a_reload_that_changes_the_cap() {
    let up = Upstream::start(Duration::from_millis(6000));
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /items: {cost: 1}\n    /reports/generate: {cost: 1, max_in_flight: 3}\n",
    );
    let c = client();
    let running: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|k| spawn_post(&c, gw.url("/reports/generate"), k))
        .collect();
    up.wait_current("/reports/generate", 3).await;
    gw.edit_config("max_in_flight: 3", "max_in_flight: 2");
    gw.edit_config("/items: {cost: 1}", "/items: {cost: 2}");
    gw.signal("HUP");
    eventually(Duration::from_secs(5), async || {
        match header(&get(&c, gw.url("/items"), "d").await, "X-RateLimit-Cost").as_deref() {
            Some("2") => Ok(()),
            other => Err(format!("reload not applied: cost {other:?}")),
        }
    })
    .await;
    for key in ["d", "e"] {
        let r = post(&c, gw.url("/reports/generate?delay_ms=1"), key).await;
        assert_eq!(r.status(), 503, "3 still run on a cap of 2");
    }
    for r in running {
        assert_eq!(r.await.unwrap(), 200);
    }
    assert_eq!(up.max_concurrent("/reports/generate"), 3);
    let r = post(&c, gw.url("/reports/generate?delay_ms=1"), "d").await;
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_endpoints_keep_metrics_small_and_reloads_quick() {
    let up = Upstream::start(Duration::ZERO);
    // Every other endpoint capped: a capped route without traffic has no more series than
    // another past the first 200.
    let endpoints: String = (0..20_000)
        .map(|i| match i % 2 {
            0 => format!("    /e{i}/items: {{cost: {}}}\n", 1 + i % 5),
            _ => format!(
                "    /e{i}/items: {{cost: {}, max_in_flight: 5}}\n",
                1 + i % 5
            ),
        })
        .collect();
    let body =
        format!("rate_limits:\n  default: {{cost: 1, window: 1m, max_cost: 100}}\n  endpoints:\n{endpoints}");
    let gw = Gateway::start(&up, &body);
    let c = client();
    assert_eq!(get(&c, gw.url("/e19999/items"), "k").await.status(), 200);
    // Counted in `logging`, which may run just after the client has its answer.
    wait_metric(
        &gw,
        "tollgate_requests_total{route=\"/e19999/items\",status=\"200\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    let scrape = admin_text(&gw, "/metrics").await;
    assert!(scrape.len() < 2_000_000, "{} bytes", scrape.len());
    // And with traffic on 100 more routes past the first 200 (each then has all its series).
    for i in 1000..1100 {
        let r = get(&c, gw.url(&format!("/e{i}/items")), &format!("k{i}")).await;
        assert_eq!(r.status(), 200);
    }
    let busy = admin_text(&gw, "/metrics").await;
    assert!(busy.len() < 2_000_000, "{} bytes after traffic", busy.len());
    // A route past the first 200 has its series once it has traffic.
    assert!(scrape.contains("tollgate_requests_total{route=\"/e19999/items\",status=\"200\"} 1"));
    assert!(scrape.contains("tollgate_in_flight_limit{route=\"/e19999/items\"} 5"));
    // Its queue too (it came only with the route's first waiter).
    assert!(scrape.contains("tollgate_queued{route=\"/e19999/items\"} 0"));
    assert!(!scrape.contains("route=\"/e19998/items\""));
    assert!(!scrape.contains("route=\"/e19997/items\""));
    // The first 200 have theirs from the start, a capped one its limit and queue too.
    assert!(scrape.contains("tollgate_in_flight_limit{route=\"/e1/items\"} 5"));
    assert!(scrape.contains("tollgate_queued{route=\"/e1/items\"} 0"));
    // A reload of the whole table is done within a few seconds.
    gw.edit_config("/e0/items: {cost: 1}", "/e0/items: {cost: 2}");
    let t = Instant::now();
    gw.signal("HUP");
    wait_metric(
        &gw,
        "tollgate_config_reloads_total{result=\"ok\"}",
        1.0,
        Duration::from_secs(10),
    )
    .await;
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "reload took {took:?}");
    let r = get(&c, gw.url("/e0/items"), "k").await;
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("2"));
    println!(
        "scrape {} bytes, {} after traffic on 100 routes, reload {took:?}",
        scrape.len(),
        busy.len()
    );
}

/// A reload that removes a capped route leaves none of its series behind, its queue's
/// included; one that takes a route's cap away removes its limit and its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_removes_the_series_of_routes_and_caps_it_removed() {
    let up = Upstream::start(Duration::ZERO);
    let body = "rate_limits:\n  default: {cost: 1, window: 1m, max_cost: 100}\n  endpoints:\n    /gone/items: {cost: 1, max_in_flight: 2}\n    /uncapped/items: {cost: 1, max_in_flight: 3}\n";
    let gw = Gateway::start(&up, body);
    let c = client();
    for path in ["/gone/items", "/uncapped/items"] {
        assert_eq!(get(&c, gw.url(path), "k").await.status(), 200);
        wait_metric(
            &gw,
            &format!("tollgate_requests_total{{route=\"{path}\",status=\"200\"}}"),
            1.0,
            Duration::from_secs(5),
        )
        .await;
    }
    let before = admin_text(&gw, "/metrics").await;
    assert!(before.contains("tollgate_queued{route=\"/gone/items\"} 0"));
    assert!(before.contains("tollgate_queued{route=\"/uncapped/items\"} 0"));
    assert!(before.contains("tollgate_in_flight_limit{route=\"/uncapped/items\"} 3"));
    gw.edit_config("    /gone/items: {cost: 1, max_in_flight: 2}\n", "");
    gw.edit_config(
        "/uncapped/items: {cost: 1, max_in_flight: 3}",
        "/uncapped/items: {cost: 1}",
    );
    gw.reload(0.0).await;
    let after = admin_text(&gw, "/metrics").await;
    let left: Vec<&str> = after
        .lines()
        .filter(|l| l.contains("route=\"/gone/items\""))
        .collect();
    assert!(left.is_empty(), "a removed route's series: {left:?}");
    for series in ["tollgate_queued{", "tollgate_in_flight_limit{"] {
        let left: Vec<&str> = after
            .lines()
            .filter(|l| l.starts_with(series) && l.contains("route=\"/uncapped/items\""))
            .collect();
        assert!(left.is_empty(), "an uncapped route's {series}: {left:?}");
    }
    // The uncapped route keeps its other series.
    assert!(after.contains("tollgate_requests_total{route=\"/uncapped/items\",status=\"200\"} 1"));
}

/// A route a reload removes keeps its series while its requests run (their counts go to
/// series still exported), and one a second reload adds back while they run carries on with
/// them: its in-flight gauge counts them, and its requests count once they end. (Removed at
/// once, the gauge of the route added back said 0 with 3 running, and their 200s were lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_removed_and_added_back_while_its_requests_run_keeps_counting_them() {
    let up = Upstream::start(Duration::ZERO);
    let route = "    /slow/items: {cost: 1}\n";
    let body = format!(
        "rate_limits:\n  default: {{cost: 1, window: 1m, max_cost: 100}}\n  endpoints:\n{route}"
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let running: Vec<_> = (0..3)
        .map(|_| {
            let req = c
                // 8 s: the two reloads and their scrapes come while they run, however slow the
                // machine.
                .get(gw.url("/slow/items?delay_ms=8000"))
                .header("X-API-Key", "k");
            tokio::spawn(async move { req.send().await.unwrap().status().as_u16() })
        })
        .collect();
    up.wait_current("/slow/items", 3).await;
    let gauge = "tollgate_in_flight{route=\"/slow/items\"}";
    assert_metric(&gw, gauge, 3.0).await;
    gw.edit_config(route, "");
    gw.reload(0.0).await;
    assert_metric(&gw, gauge, 3.0).await;
    gw.edit_config("  endpoints:\n", &format!("  endpoints:\n{route}"));
    gw.reload(1.0).await;
    assert_metric(&gw, gauge, 3.0).await;
    for r in running {
        assert_eq!(r.await.unwrap(), 200);
    }
    wait_metric(
        &gw,
        "tollgate_requests_total{route=\"/slow/items\",status=\"200\"}",
        3.0,
        Duration::from_secs(5),
    )
    .await;
    assert_metric(&gw, gauge, 0.0).await;
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/slow/items\"}", 3.0).await;
}

/// `tollgate run --pid-file`: the file names this gateway's process (a reload signals it and
/// no other tollgate on the host: docs/operations.md), and is gone after a clean exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pid_file_names_the_gateway_to_reload() {
    let up = Upstream::start(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("tollgate.pid");
    let path = pid_file.display().to_string();
    let mut gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
        args: vec!["--pid-file", &path],
        ..GatewayOpts::default()
    });
    let written = std::fs::read_to_string(&pid_file).unwrap();
    assert_eq!(written, format!("{}\n", gw.pid()));
    let status = std::process::Command::new("kill")
        .args(["-HUP", written.trim()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_metric(
        &gw,
        "tollgate_config_reloads_total{result=\"ok\"}",
        1.0,
        Duration::from_secs(10),
    )
    .await;
    gw.signal("TERM");
    assert_eq!(gw.wait_exit(Duration::from_secs(12)), Some(0));
    assert!(!pid_file.exists(), "the pid file is removed at exit");
}

/// A request keeps the config it started with, named upstreams included: one queued for a
/// capped route when a reload points the route's pool elsewhere is sent where its own config
/// said (the config, its pools and the upstream's address are swapped as one snapshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_across_a_reload_goes_to_its_own_configs_upstream() {
    let (old, new) = (
        Upstream::start(Duration::from_millis(200)),
        Upstream::start(Duration::from_millis(200)),
    );
    let body = |pool: &Upstream| {
        format!(
            "upstreams:\n  pool:\n    urls: [\"{}\"]\nrate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n    \"/svc/{{*rest}}\": {{upstream: pool, strip_prefix: /svc, max_in_flight: 1, queue_timeout: 10s}}\n",
            pool.url()
        )
    };
    let gw = Gateway::start(&old, &body(&old));
    let c = client();
    let send_to = |target: &str| {
        let (c, url) = (c.clone(), gw.url(target));
        tokio::spawn(async move { post(&c, url, "k").await.status() })
    };
    let send = || send_to("/svc/reports/generate");
    // The first keeps the slot for 5 s: the reload comes while the second still waits.
    let first = send_to("/svc/reports/generate?delay_ms=5000");
    old.wait_current("/reports/generate", 1).await;
    let queued = send();
    wait_metric(
        &gw,
        "tollgate_queued{route=\"/svc/{*rest}\"}",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    gw.edit_config(&old.url(), &new.url());
    gw.reload(0.0).await;
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(queued.await.unwrap(), 200);
    assert_eq!(
        (
            old.count("/reports/generate"),
            new.count("/reports/generate")
        ),
        (2, 0),
        "the queued request went where its config said"
    );
    // A request that starts after the reload goes to the new pool.
    assert_eq!(send().await.unwrap(), 200);
    assert_eq!(new.count("/reports/generate"), 1);
}

/// A reload that blocks (its file a FIFO nobody writes, say; or a slow DNS answer for an
/// upstream's name) keeps neither SIGTERM nor a later SIGHUP from being handled: the drain
/// starts and the process exits 0, and a SIGHUP meanwhile is one more reload after it. The
/// signal loop used to await the reload: the process went on serving past SIGTERM until
/// `kill -9`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_reload_keeps_no_signal_from_being_handled() {
    let up = Upstream::start(Duration::ZERO);
    let mut gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: "rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 100}\n",
        grace: "2s",
        ..GatewayOpts::default()
    });
    let path = gw.config_path.clone();
    std::fs::remove_file(&path).unwrap();
    let made = Command::new("mkfifo").arg(&path).status().unwrap();
    assert!(made.success());
    gw.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.signal("HUP");
    let asked = Instant::now();
    gw.signal("TERM");
    assert_eq!(
        gw.wait_exit(Duration::from_secs(10)),
        Some(0),
        "{}",
        gw.log()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        gw.log().contains("SIGHUP while a reload is still running"),
        "{}",
        gw.log()
    );
}

/// A config path whose size the file system does not know (a device, a pipe) is read up to
/// the 4 MiB bound and refused there: `check -c /dev/zero` read without end (3.8 GB in 4 s).
#[test]
fn check_refuses_an_endless_file_at_the_size_bound() {
    let start = Instant::now();
    let (code, _, err) = tollgate(&["check", "-c", "/dev/zero"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("more than the 4 MiB"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// `check` refuses the admin token `run` would refuse at start: a file that checks clean
/// then failed to start (exit 1, "TOLLGATE_ADMIN_TOKEN is 5 characters long").
#[test]
fn check_refuses_an_admin_token_run_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(
        &path,
        "upstream:\n  url: \"http://127.0.0.1:3000\"\nrate_limits:\n  default: {cost: 1, window: 60s, max_cost: 100}\n",
    )
    .unwrap();
    let check = |token: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["check", "-c"])
            .arg(&path)
            .env("TOLLGATE_ADMIN_TOKEN", token)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), err)
    };
    let (code, err) = check("short");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.starts_with("TOLLGATE_ADMIN_TOKEN is 5 characters long"),
        "{err}"
    );
    assert!(!err.contains("short"), "the token is never printed: {err}");
    let (code, err) = check("9f86d081884c7d659a2feaa0c55ad015");
    assert_eq!(code, Some(0), "{err}");
}
