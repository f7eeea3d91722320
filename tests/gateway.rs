//! One gateway process, the memory store: what an API consumer sees (DESIGN §3, §4).

mod common;

use std::io::Write as _;
use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incident_scenario_weights_throttle_the_report_customer_only() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();

    let mut passed = vec![];
    let mut rejected = 0;
    for _ in 0..60 {
        let r = post(&c, gw.url("/reports/generate"), "key-A").await;
        match r.status().as_u16() {
            200 => {
                assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("20"));
                passed.push(header(&r, "X-RateLimit-Remaining").unwrap());
            }
            429 => {
                rejected += 1;
                let ra: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
                assert!((1..=10).contains(&ra), "Retry-After {ra}");
                assert_eq!(
                    header(&r, "Content-Type").as_deref(),
                    Some("application/problem+json")
                );
                let v: serde_json::Value = r.json().await.unwrap();
                assert!(v["type"].as_str().unwrap().ends_with("quota-exceeded"));
                assert_eq!(v["status"], 429);
                assert_eq!(v["cost"], 20);
            }
            s => panic!("unexpected status {s}"),
        }
    }
    assert_eq!(passed, vec!["100", "80", "60", "40", "20", "0"]);
    assert_eq!(rejected, 54);

    for i in 0..60 {
        let r = get(&c, gw.url(&format!("/reports/{i}")), "key-B").await;
        assert_eq!(r.status(), 200, "key B call {i}");
    }
    assert_eq!(
        up.count("/reports/generate"),
        6,
        "the upstream saw exactly 6 reports"
    );
    assert_metric(
        &gw,
        "tollgate_rejections_total{reason=\"budget\",route=\"/reports/generate\"}",
        54.0,
    )
    .await;
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/reports/generate\"}",
        120.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_headers_exact_syntax() {
    let up = Upstream::start(Duration::ZERO);
    // 100 units per hour: nothing refills during the test, so every figure is exact.
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    /analytics/query: {cost: 10}\n",
    );
    let c = client();
    let r = c
        .get(gw.url("/analytics/query"))
        .header("Authorization", "Bearer k1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "RateLimit-Policy").unwrap(),
        "\"default\";q=100;w=3600"
    );
    assert_eq!(header(&r, "RateLimit").unwrap(), "\"default\";r=90;t=360");
    assert_eq!(header(&r, "X-RateLimit-Limit").unwrap(), "100");
    assert_eq!(header(&r, "X-RateLimit-Remaining").unwrap(), "90");
    assert_eq!(header(&r, "X-RateLimit-Reset").unwrap(), "360");
    assert_eq!(header(&r, "X-RateLimit-Cost").unwrap(), "10");
    assert!(r.headers().get("Retry-After").is_none());

    for _ in 0..9 {
        c.get(gw.url("/analytics/query"))
            .header("Authorization", "Bearer k1")
            .send()
            .await
            .unwrap();
    }
    let r = c
        .get(gw.url("/analytics/query"))
        .header("Authorization", "Bearer k1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    // 10 units come back every 360 s.
    assert_eq!(header(&r, "Retry-After").unwrap(), "360");
    assert_eq!(
        header(&r, "X-RateLimit-Cost").unwrap(),
        "0",
        "a refused request is charged 0"
    );
    assert_eq!(header(&r, "RateLimit").unwrap(), "\"default\";r=0;t=3600");
    assert_eq!(header(&r, "X-RateLimit-Remaining").unwrap(), "0");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["remaining"], 0);
    assert_eq!(v["retry_after"], 360);
    assert_eq!(v["title"], "Rate limit budget exceeded");
}

/// A provider's own rate-limit headers give way to the gateway's (one of each, ours), and the
/// ones the gateway does not write pass through. On the wire, ours are named as DESIGN writes
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_rate_limit_headers_replace_the_upstreams() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n",
    );
    let r = client()
        .get(gw.url("/items?ratelimit=1"))
        .header("X-API-Key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let all = |name: &str| -> Vec<String> {
        r.headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(all("RateLimit"), ["\"default\";r=99;t=36"]);
    assert_eq!(all("X-RateLimit-Remaining"), ["99"]);
    assert_eq!(
        all("X-RateLimit-Used"),
        ["5"],
        "not the gateway's: passed on"
    );
    assert_eq!(all("X-RateLimit-Cost"), ["1"]);

    // On the wire, names as DESIGN writes them, each once: also when the upstream sent only
    // `X-RateLimit-*` ones (ratelimit=2). 36 s of refill per unit: a reset of 72 s after two
    // units, 108 s after three, or a second less if that much went by since the first.
    for (query, left, reset) in [("ratelimit=1", 98, 72), ("ratelimit=2", 97, 108)] {
        let head = raw_head(gw.port, &format!("/items?{query}"));
        // Ours: each once, named as DESIGN writes them.
        let value = |name: &str| -> Vec<String> {
            head.lines()
                .filter_map(|l| l.split_once(": "))
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(n, v)| {
                    assert_eq!(n, name, "the name's case: {head}");
                    v.to_string()
                })
                .collect()
        };
        let reset_is = |v: &str| v == reset.to_string() || v == (reset - 1).to_string();
        assert_eq!(
            value("RateLimit-Policy"),
            ["\"default\";q=100;w=3600"],
            "{head}"
        );
        let rl = value("RateLimit");
        assert!(
            rl.len() == 1
                && rl[0]
                    .strip_prefix(&format!("\"default\";r={left};t="))
                    .is_some_and(reset_is),
            "{head}"
        );
        assert_eq!(value("X-RateLimit-Limit"), ["100"], "{head}");
        assert_eq!(value("X-RateLimit-Remaining"), [left.to_string()], "{head}");
        let r = value("X-RateLimit-Reset");
        assert!(r.len() == 1 && reset_is(&r[0]), "{head}");
        assert_eq!(value("X-RateLimit-Cost"), ["1"], "{head}");
        let used = head
            .lines()
            .filter(|l| l.eq_ignore_ascii_case("x-ratelimit-used: 5"));
        assert_eq!(used.count(), 1, "the upstream's own, as it sent it: {head}");
    }
}

/// The response head exactly as sent (the harness's raw reader folds names to lower case).
fn raw_head(port: u16, path: &str) -> String {
    let mut sock = raw_connect(port);
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: k1\r\nConnection: close\r\n\r\n");
    std::io::Write::write_all(&mut sock, request.as_bytes()).unwrap();
    let mut wire = Vec::new();
    std::io::Read::read_to_end(&mut sock, &mut wire).unwrap();
    let wire = String::from_utf8_lossy(&wire).into_owned();
    wire.split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_and_registry() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{INCIDENT}plans:\n  enterprise: {{max_cost: 600, window: 60s}}\nkeys:\n  - {{id: acme-prod, sha256: \"{}\", plan: enterprise}}\n  - {{id: small-co, sha256: \"{}\"}}\n",
        sha256_hex("acme-secret"),
        sha256_hex("small-secret")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();

    let r = c.get(gw.url("/items")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().get("RateLimit").is_none());
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["type"].as_str().unwrap().ends_with("unauthenticated"));

    let r = get(&c, gw.url("/items"), "not-registered").await;
    assert_eq!(r.status(), 401);

    // The enterprise plan: 600 units → 30 reports, and its own policy name in the headers.
    let mut ok = 0;
    for _ in 0..31 {
        let r = post(&c, gw.url("/reports/generate"), "acme-secret").await;
        if r.status() == 200 {
            ok += 1;
            assert_eq!(
                header(&r, "RateLimit-Policy").unwrap(),
                "\"enterprise\";q=600;w=60"
            );
        } else {
            assert_eq!(r.status(), 429);
        }
    }
    assert_eq!(ok, 30);
    // A registry key without a plan has the default budget.
    let r = get(&c, gw.url("/items"), "small-secret").await;
    assert_eq!(
        header(&r, "RateLimit-Policy").unwrap(),
        "\"default\";q=120;w=60"
    );
    assert_metric(
        &gw,
        "tollgate_rejections_by_key_total{key=\"acme-prod\"}",
        1.0,
    )
    .await;
    assert_metric(
        &gw,
        "tollgate_rejections_total{reason=\"unauthenticated\",route=\"default\"}",
        2.0,
    )
    .await;
    // No raw key anywhere in the logs.
    gw.wait_log("\"key\":\"acme-prod\"").await;
    let log = gw.log();
    assert!(!log.contains("acme-secret") && !log.contains("not-registered"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_evasion_paths_all_cost_twenty() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    let paths = [
        "/reports/generate",
        "/reports//generate",
        "/reports/./generate",
        "/x/../reports/generate",
        "/reports/%67enerate",
        "/%72eports/generate",
        "/reports/generate/",
        "/Reports/GENERATE",
    ];
    for (i, p) in paths.iter().enumerate() {
        let r = post(&c, gw.url(p), &format!("evader-{i}")).await;
        assert_eq!(r.status(), 200, "{p}");
        assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("20"), "{p}");
        assert_eq!(
            header(&r, "X-RateLimit-Remaining").as_deref(),
            Some("100"),
            "{p}"
        );
        let v: serde_json::Value = r.json().await.unwrap();
        let want = if *p == "/Reports/GENERATE" {
            "/Reports/GENERATE"
        } else {
            "/reports/generate"
        };
        assert_eq!(v["path"], want, "the upstream receives the normalized path");
    }
    let r = post(&c, gw.url("/reports/generate?format=pdf&x=%2F"), "q").await;
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["query"], "format=pdf&x=%2F", "the query passes untouched");

    for bad in [
        "/reports%2fgenerate",
        "/reports%2Fgenerate",
        "/reports%5Cgenerate",
        "/reports%00/generate",
        "/reports/%0agenerate",
        "/reports/%zz",
    ] {
        let r = post(&c, gw.url(bad), "bad").await;
        assert_eq!(r.status(), 400, "{bad}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["type"].as_str().unwrap().ends_with("bad-path"), "{bad}");
    }
    assert_eq!(up.count("/reports/generate"), 8);
    assert_eq!(up.count("/Reports/GENERATE"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_method_body_headers_and_forwarded_for() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    let r = c
        .put(gw.url("/items/7?a=1"))
        .header("X-API-Key", "k")
        .header("X-Custom", "yes")
        .header("X-Forwarded-For", "203.0.113.9")
        .body("hello")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["method"], "PUT");
    assert_eq!(v["path"], "/items/7");
    assert_eq!(v["query"], "a=1");
    assert_eq!(v["headers"]["x-custom"], "yes");
    // The peer is not in identity.trusted_proxies: what it claims is not passed on.
    assert_eq!(v["headers"]["x-forwarded-for"], "127.0.0.1");
    assert_eq!(v["headers"]["x-forwarded-proto"], "http");
    assert_eq!(v["headers"]["host"], format!("127.0.0.1:{}", up.port));

    let r = c
        .post(gw.url("/upload"))
        .header("X-API-Key", "k")
        .body(vec![7u8; 3 * 1024 * 1024])
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["bytes"], 3 * 1024 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_100_mb_both_ways_without_buffering() {
    use futures_util::StreamExt;
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    const N: u64 = 100 * 1024 * 1024;
    let r = get(&c, gw.url(&format!("/bytes/{N}")), "k").await;
    assert_eq!(r.status(), 200);
    let mut got = 0u64;
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        got += chunk.unwrap().len() as u64;
    }
    assert_eq!(got, N);

    let chunks = futures_util::stream::iter(
        (0..N / (1024 * 1024)).map(|_| Ok::<_, std::io::Error>(vec![1u8; 1024 * 1024])),
    );
    let r = c
        .post(gw.url("/upload"))
        .header("X-API-Key", "k")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["bytes"], N);

    // Peak resident memory of the gateway stays far below one body.
    let status = std::fs::read_to_string(format!("/proc/{}/status", gw.pid())).unwrap();
    let hwm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(hwm_kb < 60 * 1024, "gateway peak RSS {hwm_kb} kB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_delay_holds_the_seventh_report() {
    let up = Upstream::start(Duration::ZERO);
    let body = INCIDENT.replace("max_delay: 0s", "max_delay: 10s");
    let gw = Gateway::start(&up, &body);
    let c = client();
    for _ in 0..6 {
        let r = post(&c, gw.url("/reports/generate"), "patient").await;
        assert_eq!(r.status(), 200);
    }
    wait_idle(&gw, "/reports/generate").await;
    let t = Instant::now();
    let seventh = {
        let c = c.clone();
        let url = gw.url("/reports/generate");
        tokio::spawn(async move {
            let r = post(&c, url, "patient").await;
            let reset = header(&r, "X-RateLimit-Reset");
            (r.status().as_u16(), t.elapsed(), reset)
        })
    };
    // Admitted (counted in flight) before it is held.
    wait_in_flight(&gw, "/reports/generate", 1).await;
    // While the 7th is held, an 8th would have to wait 20 s: refused at once, and told to come
    // back when its wait would fit in max_delay (~10 s).
    let t8 = Instant::now();
    let r = post(&c, gw.url("/reports/generate"), "patient").await;
    assert_eq!(r.status(), 429);
    assert!(t8.elapsed() < Duration::from_secs(1));
    let ra: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((9..=10).contains(&ra), "Retry-After {ra}");
    let (status, held, reset) = seventh.await.unwrap();
    assert_eq!(status, 200);
    // Its headers describe the budget as it stands when it is answered, ~10 s after it was
    // decided: 140 units' drain at 2 a second was 70 s then, 60 s now (it said 70).
    let reset: u64 = reset.unwrap().parse().unwrap();
    assert!((59..=60).contains(&reset), "X-RateLimit-Reset {reset}");
    // ~10 s, less the time the first six took (a slow CI machine may take a while for them).
    assert!(
        held >= Duration::from_millis(8_000) && held < Duration::from_secs(14),
        "held {held:?}"
    );
    assert_eq!(up.count("/reports/generate"), 7);
}

/// An upstream that never completes the TCP handshake (a listener whose backlog is full:
/// the kernel drops the SYNs, as a black-holed address would) is given up on at
/// `upstream.connect_timeout` (1 s here; DESIGN §1), not waited for: 502, refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_accepts_is_given_up_at_connect_timeout() {
    use std::os::fd::AsRawFd;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // SAFETY: listen(2) on a socket this test owns, to shrink its accept queue to one.
    assert_eq!(unsafe { libc::listen(silent.as_raw_fd(), 0) }, 0);
    let port = silent.local_addr().unwrap().port();
    // The one connection the queue takes; every later handshake hangs.
    let _filler = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("http://127.0.0.1:{port}"),
        body: "rate_limits:\n  default: {cost: 2, window: 1h, max_cost: 10}\n",
        ..GatewayOpts::default()
    });
    let c = client();
    for _ in 0..2 {
        let t = Instant::now();
        let r = get(&c, gw.url("/items"), "k").await;
        let took = t.elapsed();
        assert_eq!(r.status(), 502);
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(5),
            "answered after {took:?}"
        );
        assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("0"));
        assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("10"));
    }
}

/// A 502 (the upstream never had the request) is refunded, and its rate-limit headers and
/// problem JSON say so: nothing charged, the units as they were before it (not as its charge
/// left them). Three such requests of `cost` to a gateway on `store` (YAML, or "" for memory).
async fn refunded_502s(store: &str, cost: u64) -> Gateway {
    let dead_port = free_port();
    let body = format!(
        "{store}rate_limits:\n  default: {{cost: {cost}, window: 1h, max_cost: 100}}\nkeys:\n  - {{id: k1, sha256: \"{}\"}}\n",
        sha256_hex("key-1")
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("http://127.0.0.1:{dead_port}"),
        body: &body,
        ..GatewayOpts::default()
    });
    let c = client();
    for _ in 0..3 {
        let r = get(&c, gw.url("/items"), "key-1").await;
        assert_eq!(r.status(), 502, "{store}");
        assert_eq!(
            header(&r, "Content-Type").as_deref(),
            Some("application/problem+json")
        );
        for (name, want) in [
            ("X-RateLimit-Cost", "0"),
            ("X-RateLimit-Remaining", "100"),
            ("X-RateLimit-Reset", "0"),
            ("RateLimit", "\"default\";r=100;t=0"),
        ] {
            assert_eq!(header(&r, name).as_deref(), Some(want), "{store}: {name}");
        }
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["remaining"], 100, "{store}: {v}");
    }
    gw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refunded_502_says_nothing_was_charged_on_memory_and_redis() {
    refunded_502s("", 5).await;
    let redis = Redis::start();
    let store = format!("store:\n  backend: redis\n  url: \"{}\"\n", redis.url());
    refunded_502s(&store, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_refunded() {
    // Unreachable upstream: 502, nothing charged.
    let gw = refunded_502s("", 1).await;
    let c = client();
    let v: serde_json::Value = c
        .get(gw.admin("/admin/keys/k1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["remaining"], 100, "502s are refunded: {v}");

    // Timed-out upstream: 504, charged: the upstream had the request (DESIGN §3). A gateway
    // with a read_timeout of 300 ms, key k1 on the plan given (`plans` YAML, `plan` its entry's).
    let up = Upstream::start(Duration::ZERO);
    let timing_out = |plans: &str, plan: &str| {
        let body = format!(
            "rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n{plans}keys:\n  - {{id: k1, sha256: \"{}\"{plan}}}\n",
            sha256_hex("key-1")
        );
        Gateway::start_opts(GatewayOpts {
            upstream_url: up.url(),
            body: &body,
            upstream_extra: "  read_timeout: 300ms\n",
            ..GatewayOpts::default()
        })
    };
    let gw = timing_out("", "");
    let r = get(&c, gw.url("/slow?delay_ms=2000"), "key-1").await;
    assert_eq!(r.status(), 504);
    let r = get(&c, gw.url("/items"), "key-1").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("98"));

    // On an uncapped route a 504 frees the key's own slot at once (a plan's
    // max_in_flight_per_key): only a capped route's slot follows the late answer.
    let gw = timing_out(
        "plans:\n  one: {max_cost: 100, window: 1h, max_in_flight_per_key: 1}\n",
        ", plan: one",
    );
    let r = get(&c, gw.url("/slow?delay_ms=3000"), "key-1").await;
    assert_eq!(r.status(), 504);
    let r = get(&c, gw.url("/items"), "key-1").await;
    assert_eq!(r.status(), 200, "the key's slot was still held");
}

/// A [`HangUp`] upstream (`after`), and a one-thread gateway before it where `route` costs 5
/// of registry key k1's (`key-1`) 100.
fn hang_up_gateway(route: &str, after: Duration) -> (HangUp, Gateway) {
    let up = HangUp::start(after);
    let body = format!(
        "rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n  endpoints:\n    {route}: {{cost: 5}}\nkeys:\n  - {{id: k1, sha256: \"{}\"}}\n",
        sha256_hex("key-1")
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body: &body,
        threads: 1,
        ..GatewayOpts::default()
    });
    (up, gw)
}

/// An upstream that read the request and then closed its connection without answering had
/// the request (DESIGN §3: "A request the upstream received is never refunded"): 502, the
/// charge stands, and the request is sent once — not again on a new connection when the one
/// it went on was a reused one (the upstream may have run it: it worked 300 ms on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_hangs_up_after_receiving_keeps_the_charge_and_runs_it_once() {
    let (up, gw) = hang_up_gateway("/work", Duration::from_millis(300));
    let c = client();
    let hung_up = |r: &reqwest::Response, remaining: &str| {
        assert_eq!(r.status(), 502);
        assert_eq!(header(r, "X-RateLimit-Cost").as_deref(), Some("5"));
        assert_eq!(
            header(r, "X-RateLimit-Remaining").as_deref(),
            Some(remaining)
        );
        assert_eq!(
            header(r, "Content-Type").as_deref(),
            Some("application/problem+json")
        );
    };
    // On a new connection.
    let r = get(&c, gw.url("/work?n=1"), "key-1").await;
    hung_up(&r, "95");
    assert_eq!(up.seen("/work"), vec![("/work?n=1".to_string(), 1, 1)]);

    // On a kept-alive connection the upstream answered on before. (The answer read whole,
    // the client sends its next request on the same connection, which the gateway's one
    // thread serves after it put the upstream connection back in its pool.)
    let r = get(&c, gw.url("/ok"), "key-1").await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    let r = get(&c, gw.url("/work?n=2"), "key-1").await;
    hung_up(&r, "89");
    let work = up.seen("/work");
    assert_eq!(work.len(), 2, "sent once each: {work:?}");
    assert_eq!(
        work[1].2, 2,
        "the second went on a reused connection: {work:?}"
    );
    assert_eq!(remaining(&gw, "k1").await, 89);
}

/// The same when the upstream hangs up at once, the moment it has read the request, on a new
/// connection or a kept-alive one: it had the request (it closed in order, having read all of
/// it: an unread request would have been reset), so the 502 is charged, and a GET is not sent
/// again. (Within 100 ms of sending, this was refunded as if the upstream had never received
/// it; on a kept-alive connection a GET was then run twice, a POST run and refunded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_hangs_up_at_once_after_reading_keeps_the_charge() {
    let (up, gw) = hang_up_gateway("/work", Duration::ZERO);
    let c = client();
    for n in 1..=5u64 {
        let r = get(&c, gw.url(&format!("/work?n={n}")), "key-1").await;
        assert_eq!(r.status(), 502);
        assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("5"), "#{n}");
        let left = (100 - 5 * n).to_string();
        assert_eq!(header(&r, "X-RateLimit-Remaining"), Some(left), "#{n}");
    }
    let work = up.seen("/work");
    assert_eq!(
        work.len(),
        5,
        "each sent once, on a connection of its own: {work:?}"
    );
    assert!(work.iter().all(|w| w.2 == 1), "{work:?}");

    // On a kept-alive connection the upstream answered on before (the gateway's one thread
    // puts it back in its pool before the client's next request on the same connection).
    for (n, post) in [(6u64, false), (7, true)] {
        let ok = get(&c, gw.url("/ok"), "key-1").await;
        assert_eq!(ok.status(), 200);
        ok.text().await.unwrap();
        let target = gw.url(&format!("/work?n={n}"));
        let r = match post {
            false => get(&c, target, "key-1").await,
            // No body: `HangUp` reads a request's head only (a body left unread would reset
            // the connection as it closes).
            true => c
                .post(target)
                .header("X-API-Key", "key-1")
                .send()
                .await
                .unwrap(),
        };
        assert_eq!(r.status(), 502, "#{n}");
        assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("5"), "#{n}");
        // Each `/ok` costs 1.
        let left = (100 - 5 * n - (n - 5)).to_string();
        assert_eq!(header(&r, "X-RateLimit-Remaining"), Some(left), "#{n}");
        let work = up.seen(&format!("/work?n={n}"));
        assert_eq!(work.len(), 1, "sent once: {work:?}");
        assert_eq!(work[0].2, 2, "on the kept-alive connection: {work:?}");
    }
}

/// And the other side on a new connection: an upstream that accepts and closes without
/// reading (a proxy before a dead backend) never had the request: 502, refunded, whether it
/// closes before the request arrives or with it unread in its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_without_reading_never_had_the_request() {
    for unread in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                if unread {
                    // Closed the moment the request is in its socket, unread.
                    let _ = conn.peek(&mut [0u8; 1]);
                }
                drop(conn);
            }
        });
        let body = format!(
            "rate_limits:\n  default: {{cost: 1, window: 1h, max_cost: 100}}\n  endpoints:\n    /work: {{cost: 5}}\nkeys:\n  - {{id: k1, sha256: \"{}\"}}\n",
            sha256_hex("key-1")
        );
        let gw = Gateway::start_opts(GatewayOpts {
            upstream_url: format!("http://127.0.0.1:{port}"),
            body: &body,
            threads: 1,
            ..GatewayOpts::default()
        });
        let c = client();
        for n in 0..3 {
            let r = c
                .post(gw.url("/work"))
                .header("X-API-Key", "key-1")
                .body("x")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 502, "unread {unread} #{n}");
            assert_eq!(
                header(&r, "X-RateLimit-Cost").as_deref(),
                Some("0"),
                "unread {unread} #{n}"
            );
            assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("100"));
        }
    }
}

/// The other side of that rule: a kept-alive connection the upstream closes at once, before
/// reading the request, never had it (the race with an upstream's keep-alive timeout). A GET
/// is sent again on a new connection and charged once; a POST is not sent again (it is not
/// idempotent), and its 502 is refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_closed_under_a_request_never_had_it() {
    let (up, gw) = hang_up_gateway("/stale", Duration::from_secs(5));
    let c = client();
    let ok = get(&c, gw.url("/ok"), "key-1").await;
    assert_eq!(ok.status(), 200);
    ok.text().await.unwrap();
    let r = get(&c, gw.url("/stale"), "key-1").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("5"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("94"));
    r.text().await.unwrap();
    let stale = up.seen("/stale");
    assert_eq!(
        stale.iter().map(|s| s.2).collect::<Vec<_>>(),
        vec![2, 1],
        "closed under it on the kept-alive connection, then answered on a new one: {stale:?}"
    );

    // The new connection is kept alive in turn: a POST on it is closed under it too.
    let r = c
        .post(gw.url("/stale"))
        .header("X-API-Key", "key-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("0"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("94"));
    assert_eq!(up.seen("/stale").len(), 3, "the POST was sent once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_cap_without_queue_answers_503_and_upstream_never_exceeds_cap() {
    let up = Upstream::start(Duration::from_millis(800));
    let body = incident_with_report_caps("      max_in_flight: 2\n");
    let gw = Gateway::start(&up, &body);
    let c = client();
    let rs = all_at_once(6, |i| {
        c.post(gw.url("/reports/generate"))
            .header("X-API-Key", format!("k{i}"))
    })
    .await;
    let mut ok = 0;
    let mut busy = 0;
    for r in rs {
        match r.status().as_u16() {
            200 => ok += 1,
            503 => {
                busy += 1;
                assert_eq!(header(&r, "Retry-After").as_deref(), Some("1"));
                assert_eq!(
                    header(&r, "X-RateLimit-Remaining").as_deref(),
                    Some("120"),
                    "503 is not charged"
                );
                let v: serde_json::Value = r.json().await.unwrap();
                assert!(v["type"].as_str().unwrap().ends_with("route-busy"));
            }
            s => panic!("status {s}"),
        }
    }
    assert_eq!((ok, busy), (2, 4));
    assert_eq!(up.max_concurrent("/reports/generate"), 2);
    // No queue configured: counted as `in_flight` (a queue that timed out is `route_busy`).
    assert_metric(
        &gw,
        "tollgate_rejections_total{reason=\"in_flight\",route=\"/reports/generate\"}",
        4.0,
    )
    .await;
    assert_eq!(up.count("/reports/generate"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_cap_with_queue_admits_everyone_in_turn() {
    let up = Upstream::start(Duration::from_millis(300));
    let body = incident_with_report_caps("      max_in_flight: 2\n      queue_timeout: 10s\n");
    let gw = Gateway::start(&up, &body);
    let c = client();
    let t = Instant::now();
    let rs = all_at_once(8, |i| {
        c.post(gw.url("/reports/generate"))
            .header("X-API-Key", format!("k{i}"))
    })
    .await;
    let statuses = sorted_statuses(&rs);
    assert_eq!(statuses, vec![200; 8]);
    // 8 requests, 2 at a time, 300 ms each: at least 4 rounds.
    assert!(
        t.elapsed() >= Duration::from_millis(1150),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(up.max_concurrent("/reports/generate"), 2);
    assert_eq!(up.count("/reports/generate"), 8);
    assert_metric(
        &gw,
        "tollgate_queue_wait_seconds_count{route=\"/reports/generate\"}",
        8.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_in_flight_cap_answers_429_concurrency_limit() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "{INCIDENT}plans:\n  gold: {{max_cost: 600, window: 1h, max_in_flight_per_key: 1}}\nkeys:\n  - {{id: g, sha256: \"{}\", plan: gold}}\n",
        sha256_hex("gold-key")
    );
    let gw = Gateway::start(&up, &body);
    let c = client();
    let slow = spawn_get(&c, gw.url("/items?delay_ms=800"), "gold-key");
    up.wait_current("/items", 1).await;
    let r = get(&c, gw.url("/items"), "gold-key").await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "Retry-After").as_deref(), Some("1"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["type"].as_str().unwrap().ends_with("concurrency-limit"));
    assert_metric(
        &gw,
        "tollgate_rejections_total{reason=\"key_in_flight\",route=\"default\"}",
        1.0,
    )
    .await;
    assert_metric(&gw, "tollgate_rejections_by_key_total{key=\"g\"}", 1.0).await;
    assert_eq!(slow.await.unwrap(), 200);
    // The slot was released (in the logging phase, after the answer was sent): the next call
    // passes, and only the slow call was charged.
    wait_idle(&gw, "default").await;
    let r = get(&c, gw.url("/items"), "gold-key").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("598"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_released_when_client_disconnects() {
    let up = Upstream::start(Duration::from_millis(1500));
    let body = incident_with_report_caps("      max_in_flight: 1\n");
    let gw = Gateway::start(&up, &body);
    let impatient = impatient(Duration::from_millis(200));
    let r = impatient
        .post(gw.url("/reports/generate"))
        .header("X-API-Key", "k")
        .send()
        .await;
    assert!(r.is_err(), "client gave up");
    // Pingora notices the closed client when the upstream answers; the slot is then freed.
    let c = client();
    let start = Instant::now();
    loop {
        let r = post(&c, gw.url("/reports/generate?delay_ms=1"), "k").await;
        if r.status() == 200 {
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A named https pool's health check trusts `upstream.ca_file`, as the pool's requests do:
/// its check reaches the upstream and the pool serves. (The check used the system's roots
/// only: its handshake failed, every address was unhealthy, every request a 502.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_pool_is_health_checked_with_the_configured_ca() {
    let up = TlsUpstream::start();
    let extra = format!("  ca_file: \"{}\"\n", up.ca_file.display());
    let body = format!(
        "upstreams:\n  secure:\n    urls: [\"https://localhost:{}\"]\n    health_check: {{ path: /healthz, interval: 200ms }}\n{}",
        up.port,
        INCIDENT.replace(
            "  endpoints:\n",
            "  endpoints:\n    \"/s/{*rest}\": {upstream: secure, strip_prefix: /s}\n"
        )
    );
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("https://localhost:{}", up.port),
        body: &body,
        upstream_extra: &extra,
        ..GatewayOpts::default()
    });
    eventually(Duration::from_secs(10), async || {
        let checks = up
            .api
            .seen()
            .iter()
            .filter(|s| s.target == "/healthz")
            .count();
        match checks {
            0 => Err(format!(
                "no health check reached the upstream:\n{}",
                gw.log()
            )),
            _ => Ok(()),
        }
    })
    .await;
    let r = get(&client(), gw.url("/s/items/1"), "k").await;
    assert_eq!(r.status(), 200);
    // (The pool's health checks reach the upstream too, at any moment.)
    let seen = up.api.seen();
    let last = seen.iter().rev().find(|s| s.target != "/healthz");
    assert_eq!(last.map(|s| s.target.as_str()), Some("/items/1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstream_with_sni_and_keepalive() {
    let up = TlsUpstream::start();
    let extra = format!("  ca_file: \"{}\"\n", up.ca_file.display());
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("https://localhost:{}", up.port),
        body: INCIDENT,
        upstream_extra: &extra,
        ..GatewayOpts::default()
    });
    let c = client();
    for i in 0..5 {
        let r = get(&c, gw.url(&format!("/items/{i}")), "k").await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["headers"]["host"], format!("localhost:{}", up.port));
        // Pingora returns the upstream connection to its pool after the response, before
        // the request's access event: once that is written, the next request can reuse it.
        gw.wait_access(i + 1, |_| true).await;
    }
    let sni = up.sni.lock().unwrap().clone();
    assert!(!sni.is_empty());
    assert!(
        sni.iter().all(|n| n.as_deref() == Some("localhost")),
        "{sni:?}"
    );
    // Five sequential requests over at most two TLS connections: the upstream connection is
    // kept alive and reused (without reuse, five handshakes).
    assert!(sni.len() <= 2, "{sni:?}");

    // Without the CA the certificate is refused: 502, and not charged.
    let gw2 = Gateway::start_opts(GatewayOpts {
        upstream_url: format!("https://localhost:{}", up.port),
        body: INCIDENT,
        ..GatewayOpts::default()
    });
    let r = get(&c, gw2.url("/items"), "k").await;
    assert_eq!(r.status(), 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_client_ip_budget() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        "identity:\n  anonymous: client_ip\nrate_limits:\n  default: {cost: 1, window: 1h, max_cost: 3}\n",
    );
    let c = client();
    assert_eq!(
        anonymous_gets(&c, &gw.url("/items"), 4).await,
        vec![
            (200, "2".into()),
            (200, "1".into()),
            (200, "0".into()),
            (429, "0".into())
        ]
    );
    // A key, when given, still has its own budget.
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_budgets_hold_up() {
    let up = Upstream::start(Duration::ZERO);
    // 1e8 units per second: every request passes, the bucket is never near empty.
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1s, max_cost: 100000000}\n  endpoints:\n    /big: {cost: 50000000}\n",
    );
    let c = client();
    for _ in 0..20 {
        let r = get(&c, gw.url("/items"), "k").await;
        assert_eq!(r.status(), 200);
        let rem: u64 = header(&r, "X-RateLimit-Remaining")
            .unwrap()
            .parse()
            .unwrap();
        assert!(rem >= 99_999_980, "{rem}");
        // Full again 10 ns after the decision: by the time it is answered.
        assert_eq!(header(&r, "X-RateLimit-Reset").as_deref(), Some("0"));
    }
    // Two half-budget requests in a row fit; a third right after does not, and its wait is
    // half a second, rounded up.
    let mut statuses = vec![];
    let mut last = None;
    for _ in 0..3 {
        let r = get(&c, gw.url("/big"), "big").await;
        statuses.push(r.status().as_u16());
        last = header(&r, "Retry-After");
    }
    // The third comes a few ms later: 50M units need 0.5 s to drain, so it can't fit.
    assert_eq!(statuses, [200, 200, 429]);
    assert_eq!(last.as_deref(), Some("1"));

    // 1 unit per hour.
    let gw = Gateway::start(
        &up,
        "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 1}\n",
    );
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "RateLimit").as_deref(),
        Some("\"default\";r=0;t=3600")
    );
    let r = get(&c, gw.url("/items"), "k").await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "Retry-After").as_deref(), Some("3600"));
}

/// An upstream that answers in raw bytes: each connection's request is read (one read), then
/// `answer` writes to the connection, which closes when it returns. Its URL.
fn raw_upstream(answer: impl Fn(&mut std::net::TcpStream) + Send + 'static) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut s, &mut buf);
            answer(&mut s);
        }
    });
    url
}

/// An upstream that answers with a head that is not HTTP (a four-digit status) had the
/// request: 502, charged, and the problem says its answer could not be read. (It said the
/// upstream "closed the connection without answering".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_answer_that_is_not_http_is_a_charged_502_that_says_so() {
    let url = raw_upstream(|s| {
        let _ = s.write_all(b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n");
    });
    let body = "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n";
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: url,
        body,
        ..GatewayOpts::default()
    });
    let r = get(&client(), gw.url("/x"), "key-1").await;
    assert_eq!(r.status(), 502);
    assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), Some("1"));
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("99"));
    let p: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        p["detail"],
        "the upstream's answer could not be read (it is not valid HTTP); it had the request, so the request is charged"
    );
}

/// An upstream that breaks off a short fixed-length answer (its head, 10 of its 1,000 bytes,
/// then the connection closed): the client gets what came — the head and those 10 bytes,
/// short of the length it was told, then the close — as the access log's 200 says, and as a
/// chunked answer's client does. (The head waited in the client connection's write buffer for
/// the rest of the body, and the buffer was dropped with the connection: the client got
/// nothing at all, an empty reply a client may take for a request never sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_upstream_breaks_off_reaches_the_client_as_far_as_it_came() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = raw_upstream(|s| {
        // Its head, then part of the body, then the close, each a moment apart.
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n");
        std::thread::sleep(Duration::from_millis(100));
        let _ = s.write_all(b"0123456789");
        std::thread::sleep(Duration::from_millis(100));
    });
    let body = "rate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n";
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: url,
        body,
        ..GatewayOpts::default()
    });
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\nX-API-Key: key-1\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("the connection closes")
        .ok();
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got:?}");
    assert!(
        got.contains("\r\ncontent-length: 1000\r\n")
            || got.contains("\r\nContent-Length: 1000\r\n"),
        "{got:?}"
    );
    assert!(got.ends_with("\r\n\r\n0123456789"), "{got:?}");
    let line = gw
        .wait_access(1, |l| l["route"].is_string())
        .await
        .pop()
        .unwrap();
    assert_eq!(line["status"], 200, "{line}");
}
