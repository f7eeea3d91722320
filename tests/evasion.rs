//! Cost evasion, round 3 (DESIGN §3 "Cost evasion", §5 admin token): spellings of a priced
//! path that a framework upstream runs as that path (matrix parameters, `..;`, format
//! suffixes, Unicode case folds), headers that make the upstream run something else or believe
//! another caller, request ids that bloat the log, pipelined requests, and placeholder admin
//! tokens. Each test sends what a hostile client would and looks at what the upstream got.

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

// ---- Matrix parameters, `..;`, format suffixes ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_parameters_are_charged_as_the_route_and_forwarded_as_sent() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let cases = [
        ("POST", "/reports/generate;x=1", "20"),
        ("POST", "/reports;v=2/generate", "20"),
        ("POST", "/Reports;v=2/generate;x=1;y=2?format=pdf", "20"),
        ("POST", "/analytics/query;jsessionid=abc", "10"),
        ("GET", "/reports/42;v=1", "1"),
        ("GET", "/items/3;x=1", "1"),
    ];
    for (i, (method, target, cost)) in cases.into_iter().enumerate() {
        let line = format!("{method} {target}");
        let r = raw_request(gw.port, &raw(&line, &[&format!("X-API-Key: k-matrix-{i}")]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 200, "`{line}`: {r:?}");
        assert_eq!(r.header("X-RateLimit-Cost"), Some(cost), "`{line}`");
        let seen = up.api.seen().last().map(|s| s.target.clone());
        assert_eq!(seen.as_deref(), Some(target), "`{line}`: forwarded as");
    }

    // `..;` is `..` to Tomcat and Spring: it cannot be classified safely.
    let before = up.api.seen().len();
    for target in [
        "/x/..;/reports/generate",
        "/reports/..;x=1/generate",
        "/x/%2e%2e;/reports/generate",
        "/x/..;",
        // where a later `..` would resolve it away
        "/x/..;/../reports/generate",
        "/reports/generate/..;/..",
    ] {
        let line = format!("POST {target}");
        let r = raw_request(gw.port, &raw(&line, &["X-API-Key: k-dotdot"]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 400, "`{line}`: {r:?}");
        assert!(r.is_problem("bad-path"), "`{line}`: {r:?}");
    }
    assert_eq!(up.api.seen().len(), before, "the upstream saw a `..;` path");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matrix_parameter_reports_count_against_the_cap() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &incident_with_report_caps("      max_in_flight: 2\n"));
    let c = client();
    let path = "/reports/generate;x=1";
    let rs = all_at_once(6, |i| {
        c.post(gw.url(&format!("{path}?work_ms=1500")))
            .header("X-API-Key", format!("k-cap-{i}"))
    })
    .await;
    assert_eq!(sorted_statuses(&rs), [200, 200, 503, 503, 503, 503]);
    assert!(
        up.max_concurrent(path) <= 2,
        "{} reports ran at once on a cap of 2",
        up.max_concurrent(path)
    );
    assert_eq!(up.count(path), 2);
}

fn with_suffixes(suffixes: &str) -> String {
    INCIDENT.replace(
        "rate_limits:\n",
        &format!("rate_limits:\n  match_suffixes: {suffixes}\n"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_suffixes_match_the_route_without_them() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, &with_suffixes("[\".json\", \".xml\"]"));
    let c = client();
    for (path, cost) in [
        ("/reports/generate.json", "20"),
        ("/reports/generate.XML", "20"),
        ("/analytics/query.xml;x=1", "10"),
        ("/reports/generate", "20"),
        ("/reports/generate.csv", "1"),
        ("/items/1.json", "1"),
    ] {
        let r = post(&c, gw.url(path), &format!("k-suffix-{path}")).await;
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(
            header(&r, "x-ratelimit-cost").as_deref(),
            Some(cost),
            "{path}"
        );
        let seen = up.api.seen().last().map(|s| s.target.clone());
        assert_eq!(seen.as_deref(), Some(path), "{path}: forwarded as sent");
    }
    // Without the setting a suffix is part of the path.
    let plain = Gateway::start(&up, INCIDENT);
    let r = post(&c, plain.url("/reports/generate.json"), "k-plain").await;
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("1"));
}

#[test]
fn check_refuses_bad_match_suffixes_and_matrix_patterns_with_their_paths() {
    let dir = tempfile::tempdir().unwrap();
    for (suffixes, want) in [
        ("[\".json\", \"xml\"]", "rate_limits.match_suffixes[1]"),
        ("[\".\"]", "rate_limits.match_suffixes[0]"),
        ("[\".js/on\"]", "rate_limits.match_suffixes[0]"),
    ] {
        let path = dir.path().join("gateway.yaml");
        std::fs::write(
            &path,
            format!(
                "upstream:\n  url: \"http://127.0.0.1:3000\"\n{}",
                with_suffixes(suffixes)
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["check", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{suffixes}: accepted");
        assert!(err.contains(want), "{suffixes}: {err}");
    }
    // A pattern with a matrix parameter could never match: requests are matched without them.
    let path = dir.path().join("matrix.yaml");
    std::fs::write(
        &path,
        format!(
            "upstream:\n  url: \"http://127.0.0.1:3000\"\n{}",
            INCIDENT.replace("/exports/bulk:", "/exports/bulk;v=1:")
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("\"/exports/bulk;v=1\": can never match"),
        "{err}"
    );
}

#[test]
fn explain_ignores_matrix_parameters_and_refuses_dotdot_semicolon() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(
        &path,
        format!(
            "upstream:\n  url: \"http://127.0.0.1:3000\"\n{}",
            with_suffixes("[\".json\"]")
        ),
    )
    .unwrap();
    for target in [
        "/reports/generate;x=1",
        "/reports;v=2/generate",
        "/reports/generate.json",
        // The gateway never sees a fragment: its HTTP parser drops it.
        "/reports/generate#frag",
    ] {
        let out = cli_ok(&path, &["explain", "POST", target]);
        assert!(
            out.contains("route:        /reports/generate\n") && out.contains("cost:         20"),
            "{target}: {out}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "-c"])
        .arg(&path)
        .args(["POST", "/x/..;/reports/generate"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("400 bad-path"), "{out:?}");
    // A method that is not a token is refused before it is classified, as the proxy does.
    for method in ["G@T", "", "G ET"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["explain", "-c"])
            .arg(&path)
            .args([method, "/reports/generate"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{method:?}: {text}");
        assert!(
            text.contains(": 400 (not an HTTP method"),
            "{method:?}: {text}"
        );
    }
}

// ---- Unicode case folds ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unicode_spellings_that_fold_onto_another_route_are_bad_path() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    for target in [
        "/report%C5%BF/generate", // ſ (long s) upper-cases to S
        "/analyt%C4%B1cs/query",  // ı (dotless i) upper-cases to I
        "/exports/bul%E2%84%AA",  // K (Kelvin sign) lower-cases to k
        "/%EF%AC%80/../analyt%C4%B1cs/query",
        "/analytıcs/query", // the same, sent as raw UTF-8
    ] {
        let line = format!("POST {target}");
        let r = raw_request(gw.port, &raw(&line, &["X-API-Key: k-fold"]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 400, "`{line}`: {r:?}");
        assert!(r.is_problem("bad-path"), "`{line}`: {r:?}");
    }
    assert!(up.api.seen().is_empty(), "the upstream saw a folded path");
    // Such letters elsewhere are fine: folded or not, the path is the same route.
    for (i, target) in ["/items/I%C5%9F%C4%B1k", "/users/%C5%BFam", "/caf%C3%A9"]
        .into_iter()
        .enumerate()
    {
        let line = format!("GET {target}");
        let r = raw_request(gw.port, &raw(&line, &[&format!("X-API-Key: k-ok-{i}")]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 200, "`{line}`: {r:?}");
        assert_eq!(r.header("X-RateLimit-Cost"), Some("1"), "`{line}`");
    }
}

/// A raw UTF-8 path and its percent-encoding are one route (and are forwarded in the one
/// spelling): before, `GET /prices/€` missed the `/prices/%E2%82%AC` endpoint and was charged
/// as `default`.
#[test]
fn raw_and_escaped_non_ascii_paths_are_one_route() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &INCIDENT.replace(
            "  endpoints:\n",
            "  endpoints:\n    /prices/%E2%82%AC: {cost: 30}\n",
        ),
    );
    for (i, target) in ["/prices/€", "/prices/%e2%82%ac", "/prices/%E2%82%AC"]
        .into_iter()
        .enumerate()
    {
        let line = format!("GET {target}");
        let r = raw_request(gw.port, &raw(&line, &[&format!("X-API-Key: k-euro-{i}")]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 200, "`{line}`: {r:?}");
        assert_eq!(r.header("X-RateLimit-Cost"), Some("30"), "`{line}`");
    }
    let paths: Vec<String> = up.api.seen().into_iter().map(|s| s.target).collect();
    assert_eq!(paths, ["/prices/%E2%82%AC"; 3]);
}

/// So are a raw ASCII character a path must hold escaped (RFC 3986 §3.3: `|`, `"`, `^`, `[`
/// …) and its escape in either case: `check` takes the pattern escaped, and every spelling
/// costs what it does (an upstream that decodes runs the one handler). Before, `/q%7Cx`
/// missed a `/q|x` endpoint and was charged 1, and `/q|x` missed `/q%7Cx`.
#[test]
fn raw_and_escaped_ascii_a_path_must_escape_are_one_route() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &INCIDENT.replace(
            "  endpoints:\n",
            "  endpoints:\n    /q%7Cx: {cost: 30}\n    /a%22b%5Ec%5B1%5D: {cost: 40}\n",
        ),
    );
    let cases = [
        ("/q|x", "30", "/q%7Cx"),
        ("/q%7cx", "30", "/q%7Cx"),
        ("/q%7Cx", "30", "/q%7Cx"),
        ("/a\"b^c[1]", "40", "/a%22b%5Ec%5B1%5D"),
        ("/a%22b%5ec%5b1%5d", "40", "/a%22b%5Ec%5B1%5D"),
    ];
    for (i, (target, cost, _)) in cases.iter().enumerate() {
        let line = format!("GET {target}");
        let r = raw_request(gw.port, &raw(&line, &[&format!("X-API-Key: k-ascii-{i}")]))
            .unwrap_or_else(|| panic!("`{line}`: no answer"));
        assert_eq!(r.status, 200, "`{line}`: {r:?}");
        assert_eq!(r.header("X-RateLimit-Cost"), Some(*cost), "`{line}`");
    }
    let paths: Vec<String> = up.api.seen().into_iter().map(|s| s.target).collect();
    let want: Vec<&str> = cases.iter().map(|c| c.2).collect();
    assert_eq!(paths, want);
}

/// The escape of `:`, `@` or a sub-delimiter other than `;` that spells another route
/// unescaped cannot be classified safely (an upstream that decodes the path before it routes
/// it, as WSGI, CGI and Go do, runs the unescaped route; one that routes the raw path does
/// not): 400 `bad-path`, never charged, never forwarded. Where both spellings are the same
/// route, it is that route, forwarded as it came. Before, `/v1/reports%3Agenerate` was the
/// default route, charged 1 of 20, and ran three at once on a cap of 1 (probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn escaped_delimiters_that_spell_another_route_are_refused() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &INCIDENT.replace(
            "  endpoints:\n",
            "  endpoints:\n    \"/v1/reports:generate\": {cost: 20, max_in_flight: 1}\n    \"/a+b@c\": {cost: 30}\n",
        ),
    );
    let c = client();
    for (i, (method, target, status, cost)) in [
        ("POST", "/a+b@c", 200, Some("30")),
        ("POST", "/v1/reports:generate", 200, Some("20")),
        ("POST", "/a%2Bb%40c", 400, None),
        ("POST", "/a%2bb@c", 400, None),
        ("POST", "/v1/reports%3Agenerate", 400, None),
        ("POST", "/v1/reports%3agenerate", 400, None),
        // The same route either way (`GET /reports/{id}`): that route, forwarded as sent.
        ("GET", "/reports/a%3Ab", 200, Some("1")),
    ]
    .into_iter()
    .enumerate()
    {
        let r = c
            .request(method.parse().unwrap(), gw.url(target))
            .header("X-API-Key", format!("k-delim-{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{target}");
        assert_eq!(header(&r, "X-RateLimit-Cost").as_deref(), cost, "{target}");
        if status == 400 {
            let p: serde_json::Value = r.json().await.unwrap();
            assert!(
                p["type"].as_str().unwrap().ends_with("bad-path"),
                "{target}: {p}"
            );
        }
    }
    let mut paths: Vec<String> = up.api.seen().into_iter().map(|s| s.target).collect();
    paths.sort();
    assert_eq!(paths, ["/a+b@c", "/reports/a%3Ab", "/v1/reports:generate"]);
    // explain says so too (and exits 1: not classified).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["explain", "-c"])
        .arg(&gw.config_path)
        .args(["POST", "/v1/reports%3Agenerate"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && said.contains("400 bad-path"),
        "{said}"
    );
}

// ---- Headers that change what the upstream runs, or whom it believes ----

/// A `HEAD` on a `GET` endpoint is charged as that GET and counts against its cap: the
/// upstream's framework runs the GET handler for it. (Before, it was the `default` route's:
/// cost 1, no cap.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_is_charged_as_the_get_it_stands_for() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &INCIDENT.replace(
            "  endpoints:\n",
            "  endpoints:\n    \"GET /exports/{id}\": {cost: 30, max_in_flight: 1}\n",
        ),
    );
    let c = client();
    let head = |path: &str| c.head(gw.url(path)).header("X-API-Key", "k-head").send();
    let r = head("/exports/7").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("30"));
    assert_eq!(header(&r, "x-ratelimit-remaining").as_deref(), Some("90"));
    let seen = up.api.seen().pop().unwrap();
    assert_eq!(seen.method, "HEAD");
    let units = "tollgate_cost_units_total{route=\"GET /exports/{id}\"}";
    assert_metric(&gw, units, 30.0).await;
    // Spelled `head` (DESIGN §3: charged as the METHOD it equals ignoring case), it is
    // answered as a HEAD: no body, and the connection goes on. (The client got no answer at
    // all, charged: Pingora waited for the body of the GET it thought it answered.)
    let key = "X-API-Key: k-head\r\n";
    let two = format!(
        "head /exports/8 HTTP/1.1\r\nHost: x\r\n{key}\r\nGET /exports/9 HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"
    );
    let answers = tokio::task::spawn_blocking(move || pipelined(gw.port, &two))
        .await
        .unwrap();
    assert_eq!(answers, [(200, false), (200, true)]);
    let seen = up.api.seen();
    assert_eq!(seen.len(), 3);
    // Forwarded as the METHOD it is charged as.
    assert_eq!(
        (seen[1].method.as_str(), seen[1].target.as_str()),
        ("HEAD", "/exports/8")
    );
    assert_metric(&gw, units, 90.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_and_url_override_headers_do_not_reach_the_upstream() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    let r = c
        .post(gw.url("/items/1"))
        .header("X-API-Key", "k-override")
        .header("X-HTTP-Method-Override", "DELETE")
        .header("X-HTTP-Method", "DELETE")
        .header("X-Method-Override", "DELETE")
        .header("X-Original-URL", "/reports/generate")
        .header("X-Rewrite-URL", "/reports/generate")
        .header("X_HTTP_Method_Override", "DELETE")
        .header("X-Other", "kept")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-ratelimit-cost").as_deref(), Some("1"));
    let seen = up.api.seen().pop().unwrap();
    for name in [
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        "x-original-url",
        "x-rewrite-url",
        "x_http_method_override",
    ] {
        assert!(seen.header(name).is_empty(), "{name} reached the upstream");
    }
    assert_eq!(seen.header("x-other"), ["kept"]);
    assert_eq!(seen.method, "POST");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscore_copies_of_the_credential_and_the_key_id_do_not_reach_the_upstream() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!(
        "identity:\n  forward_credentials: false\n  key_id_header: X-Tollgate-Key-Id\nkeys:\n  - id: acme-prod\n    sha256: \"{}\"\n  - id: other\n    sha256: \"{}\"\n{INCIDENT}",
        sha256_hex("acme-secret"),
        sha256_hex("other-secret"),
    );
    let gw = Gateway::start(&up, &body);
    // Mixed spellings too: CGI servers fold every '-' to '_'.
    let line = "GET /items/1";
    let r = raw_request(
        gw.port,
        &raw(
            line,
            &[
                "X-API-Key: acme-secret",
                "X_API_KEY: other-secret",
                "X-Api_Key: other-secret",
                "X_Tollgate_Key_Id: other",
                "X-Tollgate_Key-Id: other",
                "X-Tollgate-Key-Id: other",
                "X-Other: kept",
            ],
        ),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    let seen = up.api.seen().pop().unwrap();
    for (name, _) in &seen.headers {
        let folded = name.replace('_', "-");
        assert!(
            folded != "x-api-key",
            "a copy of the credential reached the upstream as {name}"
        );
        assert!(
            folded != "x-tollgate-key-id" || name == "x-tollgate-key-id",
            "a client's key id reached the upstream as {name}"
        );
    }
    assert_eq!(seen.header("x-tollgate-key-id"), ["acme-prod"]);
    assert_eq!(seen.header("x-other"), ["kept"]);
}

/// A client's `Connection` header that nominates a header the gateway sets itself (`Host`,
/// `X-Forwarded-For`, `X-Forwarded-Host`, `X-Forwarded-Proto`, in any case, alone or among
/// other names) does not make the request fail: it is forwarded and charged as any other,
/// with the gateway's own values of those headers, and nothing is logged as an error. Other
/// names it nominates are still hop-by-hop: removed before forwarding, as before. (Before:
/// admitted, then Pingora refused to forward it — 400 "its framing is malformed", refunded —
/// with an ERROR line every time: any client could flood the error log.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_naming_a_header_the_gateway_sets_is_forwarded() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let nominations = [
        "X-Forwarded-For",
        "host",
        "X-FORWARDED-HOST",
        "x-forwarded-proto",
        "keep-alive, X-Forwarded-For,X-Hop , Host",
    ];
    for (i, nominated) in nominations.iter().enumerate() {
        let request = format!(
            "POST /analytics/query HTTP/1.1\r\nHost: api.example\r\nX-API-Key: k-conn\r\nConnection: {nominated}\r\nX-Hop: hop\r\nX-Forwarded-For: 198.51.100.9\r\nContent-Length: 0\r\n\r\n"
        );
        let port = gw.port;
        let r = tokio::task::spawn_blocking(move || raw_request(port, request.as_bytes()))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("`Connection: {nominated}`: no answer"));
        assert_eq!(r.status, 200, "`Connection: {nominated}`: {r:?}");
        let left = (110 - 10 * i).to_string();
        assert_eq!(
            (
                r.header("x-ratelimit-cost"),
                r.header("x-ratelimit-remaining")
            ),
            (Some("10"), Some(left.as_str())),
            "`Connection: {nominated}`"
        );
        let seen = up.api.seen().pop().unwrap();
        assert_eq!(seen.target, "/analytics/query");
        assert_eq!(seen.header("x-forwarded-for"), ["127.0.0.1"]);
        assert_eq!(seen.header("x-forwarded-host"), ["api.example"]);
        assert_eq!(seen.header("x-forwarded-proto"), ["http"]);
        assert_eq!(seen.header("host").len(), 1, "{:?}", seen.headers);
        assert!(seen.header("connection").is_empty(), "{:?}", seen.headers);
        let hop: &[&str] = if nominated.contains("X-Hop") {
            &[]
        } else {
            &["hop"]
        };
        assert_eq!(seen.header("x-hop"), hop, "`Connection: {nominated}`");
    }
    assert_eq!(up.count("/analytics/query"), 5);
    assert_metric(
        &gw,
        "tollgate_cost_units_total{route=\"/analytics/query\"}",
        50.0,
    )
    .await;
    // Each request's access line comes after any error line it made.
    let lines = gw
        .wait_access(5, |e| e["route"] == "/analytics/query")
        .await;
    assert!(
        lines.iter().all(|l| l["decision"] == "admitted"),
        "{lines:?}"
    );
    assert!(error_lines(&gw).is_empty(), "{:?}", error_lines(&gw));
}

/// `Connection` options Pingora refuses when it forwards: one that is not a token (quoted,
/// with a space, `:authority`) is dropped and the request forwarded; ten or more are a 400
/// before anything is charged. Each was admitted, then failed as malformed with an ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_options_pingora_would_refuse_are_settled_before_admission() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let send = |connection: &str| {
        let request = format!(
            "POST /analytics/query HTTP/1.1\r\nHost: api.example\r\nX-API-Key: k-conn\r\nConnection: {connection}\r\nX-Hop: hop\r\nContent-Length: 0\r\n\r\n"
        );
        let port = gw.port;
        tokio::task::spawn_blocking(move || raw_request(port, request.as_bytes()))
    };
    for (i, odd) in ["\"x-hop\"", "x y", ":authority", "keep-alive, \"q\", X-Hop"]
        .iter()
        .enumerate()
    {
        let r = send(odd).await.unwrap().expect("an answer");
        assert_eq!(r.status, 200, "`Connection: {odd}`: {r:?}");
        let left = (110 - 10 * i).to_string();
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(left.as_str()),
            "{odd}"
        );
    }
    let many = "a, b, c, d, e, f, g, h, i, j";
    let r = send(many).await.unwrap().expect("an answer");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.is_problem("bad-request"), "{r:?}");
    assert_eq!(r.header("x-ratelimit-cost"), None);
    assert_eq!(up.count("/analytics/query"), 4);
    gw.wait_access(5, |e| {
        e["route"] == "/analytics/query" || e["status"] == 400
    })
    .await;
    assert!(error_lines(&gw).is_empty(), "{:?}", error_lines(&gw));
}

const CLAIMS: [(&str, &str); 20] = [
    ("Forwarded", "for=203.0.113.7;proto=https"),
    ("X-Real-IP", "203.0.113.7"),
    ("True-Client-IP", "203.0.113.7"),
    ("X-Client-IP", "203.0.113.7"),
    ("X-Forwarded-Port", "443"),
    ("X-Forwarded-Prefix", "/admin"),
    ("Client-IP", "203.0.113.7"),
    ("X-Cluster-Client-IP", "203.0.113.7"),
    ("CF-Connecting-IP", "203.0.113.7"),
    ("Fastly-Client-IP", "203.0.113.7"),
    ("X-Original-Forwarded-For", "203.0.113.7"),
    ("X-Forwarded", "for=203.0.113.7"),
    ("X-Remote-IP", "203.0.113.7"),
    ("X-Remote-Addr", "203.0.113.7"),
    ("X-Forwarded-Ssl", "on"),
    ("X-Forwarded-Scheme", "https"),
    ("X-Url-Scheme", "https"),
    ("Front-End-Https", "on"),
    ("X-Forwarded-Server", "admin.internal"),
    ("X-Original-Host", "admin.internal"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_claims_pass_only_from_trusted_proxies() {
    let up = Upstream::start(Duration::ZERO);
    let body = format!("identity:\n  trusted_proxies: [\"127.0.0.2/32\"]\n{INCIDENT}");
    let gw = Gateway::start(&up, &body);
    let from = |ip: &str| {
        reqwest::Client::builder()
            .local_address(ip.parse::<std::net::IpAddr>().unwrap())
            .build()
            .unwrap()
    };
    let send = |c: reqwest::Client| {
        let mut rb = c
            .get(gw.url("/items/1"))
            .header("X-API-Key", "k-claims")
            .header("X-Forwarded-For", "198.51.100.1");
        for (name, value) in CLAIMS {
            rb = rb.header(name, value);
        }
        rb.send()
    };

    // A direct client: the upstream hears of it only through X-Forwarded-For, its real address.
    let r = send(from("127.0.0.1")).await.unwrap();
    assert_eq!(r.status(), 200);
    let seen = up.api.seen().pop().unwrap();
    for (name, _) in CLAIMS {
        assert!(
            seen.header(name).is_empty(),
            "{name} from an untrusted peer reached the upstream"
        );
    }
    assert_eq!(seen.header("x-forwarded-for"), ["127.0.0.1"]);

    // The load balancer's claims are its own to make: kept, and its chain extended as before.
    let r = send(from("127.0.0.2")).await.unwrap();
    assert_eq!(r.status(), 200);
    let seen = up.api.seen().pop().unwrap();
    for (name, value) in CLAIMS {
        assert_eq!(seen.header(name), [value], "{name} from the trusted proxy");
    }
    assert_eq!(seen.header("x-forwarded-for"), ["198.51.100.1, 127.0.0.2"]);
}

// ---- Request ids ----

fn is_generated_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_or_odd_request_id_is_replaced_by_a_generated_one() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let c = client();
    let huge = "a".repeat(1_000_000);
    for _ in 0..3 {
        // No key: a 401, which is logged too.
        let r = c
            .get(gw.url("/items/1"))
            .header("X-Request-Id", &huge)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }
    let too_long = "b".repeat(129);
    for (i, id) in [
        huge.as_str(),
        too_long.as_str(),
        "a b",
        "id\"with<quote>",
        "x/y",
    ]
    .into_iter()
    .enumerate()
    {
        let r = c
            .get(gw.url("/items/1"))
            .header("X-API-Key", format!("k-id-{i}"))
            .header("X-Request-Id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let seen = up.api.seen().pop().unwrap();
        let sent = seen.header("x-request-id");
        assert!(
            sent.len() == 1 && is_generated_id(sent[0]),
            "#{i}: the upstream got {} id(s), the first {} chars long",
            sent.len(),
            sent.first().map_or(0, |s| s.len())
        );
    }
    // A fair id is kept, at the upstream and in the log.
    let fair = format!("{}-Ab.9:_", "z".repeat(120));
    let r = c
        .get(gw.url("/items/1"))
        .header("X-API-Key", "k-fair")
        .header("X-Request-Id", &fair)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        up.api.seen().pop().unwrap().header("x-request-id"),
        [fair.as_str()]
    );
    // Another spelling of the header (one variable to a CGI-style server) does not bring an
    // unchecked id beside the gateway's: removed. It reached the upstream as sent.
    let r = c
        .get(gw.url("/items/1"))
        .header("X-API-Key", "k-under")
        .header("X_Request_Id", "x/y")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = up.api.seen().pop().unwrap();
    assert!(seen.header("x_request_id").is_empty());
    assert!(is_generated_id(seen.header("x-request-id")[0]));

    gw.wait_access(10, |_| true).await;
    let log = gw.log();
    assert!(
        log.len() < 200_000,
        "the log is {} bytes: a client's id was written whole",
        log.len()
    );
    let ids: Vec<String> = gw
        .access_log()
        .iter()
        .map(|e| e["request_id"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(ids.len(), 10, "{ids:?}");
    assert_eq!(
        ids.iter().filter(|id| is_generated_id(id)).count(),
        9,
        "{ids:?}"
    );
    assert!(ids.contains(&fair));
}

// ---- Pipelining ----

/// Sends `requests` on one connection at once and reads until the server closes it: each
/// answer's status, and whether it said `Connection: close`.
fn pipelined(port: u16, requests: &str) -> Vec<(u16, bool)> {
    let mut s = raw_connect(port);
    s.write_all(requests.as_bytes()).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    // Each answer's head starts with its status line (the bodies are JSON).
    text.split("HTTP/1.1 ")
        .skip(1)
        .map(|answer| {
            let head = &answer[..answer.find("\r\n\r\n").unwrap_or(answer.len())];
            let close = head.to_ascii_lowercase().contains("\r\nconnection: close");
            (head[..3].parse().unwrap(), close)
        })
        .collect()
}

/// The incident config with `/upload` costing `cost`: the pipelining tests' POSTs go there
/// because it reads its body (an upstream that answers without reading it closes the
/// connection, and a POST Pingora's pool sends on it as it closes is a 502).
fn uploads_cost(up: &Upstream, cost: u64) -> Gateway {
    let endpoint = format!("  endpoints:\n    /upload:\n      cost: {cost}\n");
    Gateway::start(up, &INCIDENT.replace("  endpoints:\n", &endpoint))
}

/// DESIGN §3: pipelined requests are never dropped, also behind a refused request with a body.
/// The 7th upload (6 × 20 = 120 units) is refused with its 2-byte body unread: the gateway
/// reads it past and answers the two GETs behind it. (Before, the 429 went with
/// `Connection: close` and the GETs were lost.)
#[test]
fn pipelined_requests_behind_a_refused_body_are_answered() {
    let up = Upstream::start(Duration::ZERO);
    let gw = uploads_cost(&up, 20);
    let report = "POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-body\r\nContent-Length: 2\r\n\r\n{}";
    let mut all = report.repeat(7);
    all += "GET /items/0 HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-get\r\n\r\n";
    all +=
        "GET /items/1 HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-get\r\nConnection: close\r\n\r\n";
    let answers = pipelined(gw.port, &all);
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 200, 429, 200, 200]);
    assert!(!answers[6].1, "the 429 keeps the connection");
    assert_eq!(up.count("/upload"), 6);
    assert_eq!(up.count("/items/0") + up.count("/items/1"), 2);
}

/// `Content-Length: 2, 2` (one length, repeated) reaches the upstream as `Content-Length: 2`
/// (RFC 9110 §8.6: a recipient replaces such a list with the single value before forwarding
/// it). It was forwarded as sent, which an upstream may read otherwise than the gateway did:
/// hyper answered 400, and the key paid 20 for it.
#[test]
fn a_repeated_content_length_is_forwarded_as_one() {
    let up = Upstream::start(Duration::ZERO);
    let gw = uploads_cost(&up, 20);
    let r = raw_request(
        gw.port,
        b"POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-cl\r\nContent-Length: 2, 2\r\nConnection: close\r\n\r\n{}",
    )
    .expect("an answer");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.header("x-ratelimit-cost"), Some("20"));
    let seen = up.api.seen();
    let upload = seen
        .iter()
        .find(|s| s.target == "/upload")
        .expect("forwarded");
    assert_eq!(upload.header("content-length"), vec!["2"]);
    assert_eq!(up.api.uploads_completed(), 1);
    // On separate lines too, however the length is spelled: an upstream that refuses the
    // repetition (nginx answers 400) ran nothing, and the key was charged 20 for it.
    for (i, lines) in [
        "Content-Length: 2\r\nContent-Length: 2\r\n",
        "Content-Length: 2\r\ncontent-length: 02\r\n",
        "Content-Length: 2\r\nContent-Length: 2\r\nCONTENT-LENGTH: 2, 2\r\n",
    ]
    .into_iter()
    .enumerate()
    {
        let r = raw_request(
            gw.port,
            format!("POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-cl{i}\r\n{lines}Connection: close\r\n\r\n{{}}").as_bytes(),
        )
        .expect("an answer");
        assert_eq!(r.status, 200, "{lines}: {r:?}");
        let seen = up.api.seen();
        let upload = seen
            .iter()
            .filter(|s| s.target == "/upload")
            .nth(i + 1)
            .expect("forwarded");
        assert_eq!(upload.header("content-length"), vec!["2"], "{lines}");
        assert_eq!(up.api.uploads_completed(), i as u64 + 2, "{lines}");
    }
}

/// The same behind a chunked body; but a body the client holds back for a `100 Continue`
/// (`Expect`), or one stated over 1 MiB, is not read past: its refusal says
/// `Connection: close` and the connection ends. (Those two send nothing after the refused
/// head: bytes left unread when the server closes make its kernel reset the connection, which
/// can drop the 429 before it leaves, and the test would fail once in a while.)
#[test]
fn a_refused_body_is_read_past_unless_held_back_or_too_long() {
    let up = Upstream::start(Duration::ZERO);
    let gw = uploads_cost(&up, 120);
    let post = |key: &str, head: &str, body: &str| {
        format!("POST /upload HTTP/1.1\r\nHost: localhost\r\nX-API-Key: {key}\r\n{head}\r\n{body}")
    };
    let chunked = ("Transfer-Encoding: chunked\r\n", "2\r\n{}\r\n0\r\n\r\n");
    let cases = [
        (
            "k-chunk",
            chunked,
            vec![(200, false), (429, false), (200, true)],
        ),
        (
            "k-expect",
            ("Expect: 100-continue\r\nContent-Length: 2\r\n", ""),
            vec![(200, false), (429, true)],
        ),
        (
            "k-large",
            ("Content-Length: 2000000\r\n", ""),
            vec![(200, false), (429, true)],
        ),
    ];
    for (key, (head, body), want) in cases {
        // The budget's 120 units go to the first upload (a 2-byte chunked body).
        let mut all = post(key, chunked.0, chunked.1);
        all += &post(key, head, body);
        if want.len() == 3 {
            all += &format!("GET /items/1 HTTP/1.1\r\nHost: localhost\r\nX-API-Key: {key}-get\r\nConnection: close\r\n\r\n");
        }
        assert_eq!(pipelined(gw.port, &all), want, "{key}");
    }
    assert_eq!(up.count("/items/1"), 1);
    assert_eq!(up.count("/upload"), 3);
}

/// A 502 for a request whose body the gateway did not forward (the upstream was unreachable)
/// goes out at once; then, as after a refusal, the gateway reads past the body so that the
/// connection goes on: a client that sends it and a next request gets that answered. One that
/// never sends it has its connection closed after the 2 s such a read may take. (Before, the
/// connection always closed after an upstream error, dropping what was pipelined.)
#[test]
fn a_502_reads_past_the_body_it_did_not_forward() {
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: "http://127.0.0.1:1".into(),
        body: INCIDENT,
        ..GatewayOpts::default()
    });
    let head = b"POST /items HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-502\r\nContent-Length: 100\r\n\r\n";
    let mut s = raw_connect(gw.port);
    s.write_all(head).unwrap();
    let asked = Instant::now();
    let r = read_raw_response(&mut s).expect("an answer");
    assert_eq!(r.status, 502, "{r:?}");
    assert!(
        asked.elapsed() < Duration::from_millis(1900),
        "the 502 waited for the body"
    );
    s.write_all(&[b'x'; 100]).unwrap();
    s.write_all(&raw("GET /items/1", &["X-API-Key: k-502"]))
        .unwrap();
    let next = read_raw_response(&mut s).expect("the next request answered");
    assert_eq!(next.status, 502, "{next:?}");
    // Never sent: closed once the read past it gives up.
    let mut s = raw_connect(gw.port);
    s.write_all(head).unwrap();
    let r = read_raw_response(&mut s).expect("an answer");
    assert_eq!(r.status, 502, "{r:?}");
    s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
    let waited = Instant::now();
    let mut rest = [0u8; 64];
    match s.read(&mut rest) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the connection stayed open: {other:?}"),
    }
    assert!(
        waited.elapsed() < Duration::from_secs(5),
        "{:?}",
        waited.elapsed()
    );
}

/// DESIGN §3: pipelined requests are never dropped, also behind a 502 (an upstream nobody
/// listens on) or a 504 (an upstream slower than `read_timeout`) whose request was whole: the
/// requests behind them are answered on the same connection. (Before, the 502 and the 504
/// went with `Connection: close` and what followed them was lost, never forwarded.)
#[test]
fn pipelined_requests_behind_an_upstream_failure_are_answered() {
    let up = Upstream::start(Duration::ZERO);
    // Port 1: nothing listens there (a free port could be taken by another test meanwhile).
    let body = "upstreams:\n  dead: {url: \"http://127.0.0.1:1\"}\nrate_limits:\n  default: {cost: 1, window: 1h, max_cost: 100}\n  endpoints:\n    \"/dead/{*rest}\": {upstream: dead}\n";
    let gw = Gateway::start_opts(GatewayOpts {
        upstream_url: up.url(),
        body,
        upstream_extra: "  read_timeout: 500ms\n",
        ..GatewayOpts::default()
    });
    let get = |target: &str, close: &str| {
        format!("GET {target} HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-fail\r\n{close}\r\n")
    };
    // A POST whose body was read whole goes on too.
    let post = "POST /dead/x HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-fail\r\nContent-Length: 2\r\n\r\n{}";
    for (first, want) in [
        (get("/dead/x", ""), 502),
        (get("/items/slow?delay_ms=2000", ""), 504),
        (post.to_string(), 502),
    ] {
        let all = first.clone() + &get("/items/1", "") + &get("/items/2", "Connection: close\r\n");
        let answers = pipelined(gw.port, &all);
        assert_eq!(
            answers,
            [(want, false), (200, false), (200, true)],
            "behind {first}"
        );
    }
    assert_eq!(up.count("/items/1") + up.count("/items/2"), 6);
}

#[test]
fn pipelined_requests_are_all_answered_in_order() {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(&up, INCIDENT);
    let mut all = Vec::new();
    for i in 0..10 {
        let close = if i == 9 { "Connection: close\r\n" } else { "" };
        all.extend_from_slice(
            format!(
                "GET /items/{i} HTTP/1.1\r\nHost: localhost\r\nX-API-Key: k-pipe\r\n{close}\r\n"
            )
            .as_bytes(),
        );
    }
    let mut s = raw_connect(gw.port);
    s.write_all(&all).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    while let Ok(n) = s.read(&mut chunk) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    let answered = text.matches("HTTP/1.1 200").count();
    assert_eq!(answered, 10, "{answered} of 10 pipelined requests answered");
    let mut at = 0;
    for i in 0..10 {
        let needle = format!("\"path\":\"/items/{i}\"");
        let pos = text[at..]
            .find(&needle)
            .unwrap_or_else(|| panic!("answer {i} missing or out of order"));
        at += pos + needle.len();
    }
}

// ---- Admin token ----

/// Starts `tollgate run` with `TOLLGATE_ADMIN_TOKEN=token`; its exit code and stderr if it
/// exited within 10 s (`None`: still running, killed).
fn run_with_token(token: &str) -> Option<(i32, String)> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(
        &path,
        format!(
            "server:\n  listen: \"127.0.0.1:{}\"\n  admin_listen: \"127.0.0.1:{}\"\n  grace_period: 1s\nupstream:\n  url: \"http://127.0.0.1:3000\"\n{INCIDENT}",
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "-c"])
        .arg(&path)
        .env("TOLLGATE_ADMIN_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Reap(child);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Some(status) = child.0.try_wait().unwrap() {
            let mut err = String::new();
            child
                .0
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some((status.code().unwrap_or(-1), err));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn a_short_or_placeholder_admin_token_is_refused_at_start() {
    for token in [
        "CHANGE-ME",
        "short-token",
        "secret",
        "Password",
        "please-change-me-0123456789",
        "CHANGEME0123456789abcdef",
        // Long, but one word said three times.
        "passwordpasswordpassword",
        // A template's placeholder, and guessable words with digits (a probe started with each).
        "<your-admin-token>",
        "password1234567890",
        // Set but empty (a secret that is missing): it served /admin/* to anyone.
        "",
        // No Authorization header carries it: it locked everyone out.
        "                    ",
    ] {
        let Some((code, err)) = run_with_token(token) else {
            panic!("a gateway with the admin token {token:?} kept running");
        };
        assert_ne!(code, 0, "{token:?}");
        assert!(err.contains("TOLLGATE_ADMIN_TOKEN"), "{token:?}: {err}");
        if token.len() > 8 {
            assert!(
                !err.contains(token),
                "{token:?}: the token was echoed: {err}"
            );
        }
    }
    assert_eq!(
        run_with_token("0f3c9a7e5b1d4c2a8e6f0b9d7c5a3e1f"),
        None,
        "a good token"
    );
}
