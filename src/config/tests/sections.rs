//! The sections added this round: edge settings, cost fidelity, several budgets, named
//! upstreams.

use super::*;

#[test]
fn edge_settings_have_design_defaults() {
    let c = parse(BASE).unwrap();
    assert_eq!(c.client_limits.header_timeout, Duration::from_secs(10));
    assert_eq!(c.client_limits.body_timeout, Duration::from_secs(30));
    assert_eq!(c.client_limits.send_timeout, Duration::from_secs(30));
    assert_eq!(c.client_limits.idle_timeout, Duration::from_secs(60));
    assert_eq!(c.client_limits.max_connections, 10_000);
    assert!(c.forward_credentials);
    assert_eq!(c.key_id_header, None);
    let y = c.redacted_yaml();
    for field in [
        "header_timeout: 10s",
        "body_timeout: 30s",
        "send_timeout: 30s",
        "idle_timeout: 1m",
        "max_connections: 10000",
        "forward_credentials: true",
        "key_id_header: ''",
    ] {
        assert!(y.contains(field), "{field} in {y}");
    }
}

#[test]
fn edge_settings_parse() {
    let s = format!(
        "server:\n  header_timeout: 2s\n  body_timeout: 500ms\n  send_timeout: 1m\n  idle_timeout: 5s\n  max_connections: 1\nidentity:\n  forward_credentials: false\n  key_id_header: X-Tollgate-Key-Id\n{BASE}"
    );
    let c = parse(&s).unwrap();
    assert_eq!(c.client_limits.header_timeout, Duration::from_secs(2));
    assert_eq!(c.client_limits.body_timeout, Duration::from_millis(500));
    assert_eq!(c.client_limits.send_timeout, Duration::from_secs(60));
    assert_eq!(c.client_limits.idle_timeout, Duration::from_secs(5));
    assert_eq!(c.client_limits.max_connections, 1);
    assert!(!c.forward_credentials);
    assert_eq!(
        c.key_id_header.as_ref().map(|h| h.as_str()),
        Some("x-tollgate-key-id")
    );
    let y = c.redacted_yaml();
    assert!(y.contains("key_id_header: X-Tollgate-Key-Id"), "{y}");
    assert!(y.contains("forward_credentials: false"), "{y}");
}

#[test]
fn edge_settings_errors_name_the_field() {
    let server = |line: &str| first_error(&format!("server:\n  {line}\n{BASE}"));
    assert_eq!(
        server("header_timeout: 0s"),
        "server.header_timeout: must be greater than 0"
    );
    assert_eq!(
        server("body_timeout: 0s"),
        "server.body_timeout: must be greater than 0"
    );
    assert_eq!(
        server("send_timeout: 0ms"),
        "server.send_timeout: must be greater than 0"
    );
    assert!(server("send_timeout: 30").starts_with("server.send_timeout: "));
    assert_eq!(
        server("idle_timeout: 0s"),
        "server.idle_timeout: must be greater than 0"
    );
    assert!(
        server("max_connections: 0")
            .starts_with("server.max_connections: must be an integer between 1 and"),
        "{}",
        server("max_connections: 0")
    );
    assert!(server("max_connections: -5").starts_with("server.max_connections: "));
    assert!(server("max_connections: many").starts_with("server.max_connections: invalid type"));

    let identity = |body: &str| first_error(&format!("identity:\n{body}\n{BASE}"));
    assert!(identity("  forward_credentials: sometimes")
        .starts_with("identity.forward_credentials: invalid type"));
    for (name, why) in [
        ("X Key", "not a valid header name"),
        ("x-api-key", "an identity source"),
        ("X-API-Key", "an identity source"),
        ("Authorization", "authorization"),
        ("content-length", "framing"),
        ("Host", "framing"),
    ] {
        let e = identity(&format!("  key_id_header: \"{name}\""));
        assert!(e.starts_with("identity.key_id_header: "), "{name}: {e}");
        assert!(e.contains(why), "{name}: {e}");
    }
    let e = identity("  sources: [\"header:x-key\"]\n  key_id_header: X-KEY");
    assert!(e.contains("an identity source"), "{e}");
    // Not a source here: allowed.
    assert!(parse(&format!(
        "identity:\n  sources: [\"header:x-key\"]\n  key_id_header: x-api-key\n{BASE}"
    ))
    .is_ok());
}

#[test]
fn fidelity_settings_parse_and_override() {
    // Global shadow, one endpoint enforced, one billed by time.
    let s = BASE
        .replace("rate_limits:\n", "rate_limits:\n  mode: shadow\n")
        .replace("      cost: 15\n", "      cost: 15\n      mode: enforce\n")
        .replace(
            "      cost: 10\n",
            "      cost: 10\n      cost_per_second: 4\n",
        );
    let c = parse(&s).unwrap();
    let route = |m: &str, p: &str| c.router.classify(m, p).route.fidelity.clone();
    assert!(route("POST", "/reports/generate").shadow);
    assert!(!route("POST", "/exports/bulk").shadow);
    assert_eq!(route("POST", "/analytics/query").cost_per_second, Some(4.0));
    assert!(c.router.default_route().fidelity.shadow);
    // Enforce is the default.
    let c = parse(BASE).unwrap();
    assert_eq!(
        c.router.default_route().fidelity,
        route::Fidelity::default()
    );

    let bad = BASE.replace(
        "      cost: 10\n",
        "      cost: 10\n      cost_per_second: 0\n",
    );
    assert_eq!(
        first_error(&bad),
        "rate_limits.endpoints.\"/analytics/query\".cost_per_second: must be a positive number of units per second (at most 1000000), got 0"
    );
    let bad = BASE.replace("rate_limits:\n", "rate_limits:\n  mode: dry-run\n");
    assert!(
        first_error(&bad).starts_with("rate_limits.mode: unknown variant"),
        "{}",
        first_error(&bad)
    );
}

#[test]
fn cost_from_response_names_a_header() {
    let with = |name: &str| {
        BASE.replace(
            "      cost: 10\n",
            &format!(
                "      cost: 10\n      cost_per_second: 4\n      cost_from_response: \"{name}\"\n"
            ),
        )
    };
    let c = parse(&with("X-Actual-Cost")).unwrap();
    let f = c
        .router
        .classify("GET", "/analytics/query")
        .route
        .fidelity
        .clone();
    assert_eq!(
        (
            f.cost_from_response.as_ref().map(|h| h.as_str()),
            f.cost_per_second
        ),
        (Some("x-actual-cost"), Some(4.0)),
        "combinable with cost_per_second"
    );
    assert_eq!(
        first_error(&with("X Actual")),
        "rate_limits.endpoints.\"/analytics/query\".cost_from_response: must be a valid HTTP header name, got \"X Actual\""
    );
    assert_eq!(
        first_error(&with("")),
        "rate_limits.endpoints.\"/analytics/query\".cost_from_response: must be a valid HTTP header name, got \"\""
    );
    assert_eq!(
        first_error(&with("Content-Length")),
        "rate_limits.endpoints.\"/analytics/query\".cost_from_response: must not be a header that frames or routes the response, got \"Content-Length\""
    );
}

#[test]
fn final_cost_bills_time_but_never_less_than_cost() {
    let f = route::Fidelity {
        shadow: false,
        cost_per_second: Some(4.0),
        cost_from_response: None,
    };
    let s = Duration::from_millis;
    assert_eq!(f.final_cost(1, Some(s(1500))), 6);
    assert_eq!(f.final_cost(10, Some(s(1500))), 10);
    assert_eq!(f.final_cost(1, Some(s(1501))), 7, "rounded up");
    assert_eq!(
        f.final_cost(3, None),
        3,
        "no upstream time: the admission cost"
    );
    assert_eq!(route::Fidelity::default().final_cost(3, Some(s(9000))), 3);
}

#[test]
fn plans_with_several_budgets() {
    let ok = format!(
        "{BASE}plans:\n  pro:\n    budgets:\n      - {{ name: minute, max_cost: 120, window: 60s }}\n      - {{ name: day, max_cost: 20000, window: 24h }}\n  solo:\n    budgets: [{{ name: minute, max_cost: 60, window: 60s }}]\n"
    );
    let c = parse(&ok).unwrap();
    let pro = &c.plans["pro"];
    let names: Vec<&str> = pro.budgets.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["pro-minute", "pro-day"]);
    assert_eq!(pro.also.len(), 1);
    assert_eq!(
        pro.headers.policy,
        "\"pro-minute\";q=120;w=60, \"pro-day\";q=20000;w=86400"
    );
    let solo = &c.plans["solo"];
    assert_eq!(
        solo.budgets[0].name, "solo",
        "one budget is named by the plan"
    );
    assert!(solo.also.is_empty());

    let both = format!(
        "{BASE}plans:\n  pro:\n    max_cost: 10\n    window: 1s\n    budgets: [{{ name: a, max_cost: 120, window: 60s }}]\n"
    );
    assert!(first_error(&both).starts_with("plans.pro.budgets: replaces max_cost and window"));
    let small = format!(
        "{BASE}plans:\n  pro:\n    budgets: [{{ name: a, max_cost: 120, window: 60s }}, {{ name: b, max_cost: 10, window: 1h }}]\n"
    );
    let e = parse(&small).unwrap_err().to_string();
    assert!(
        e.contains("plans.pro.budgets[1]"),
        "a cost over any budget's max_cost is an error: {e}"
    );
    let dup = format!(
        "{BASE}plans:\n  pro:\n    budgets: [{{ name: a, max_cost: 120, window: 60s }}, {{ name: a, max_cost: 200, window: 1h }}]\n"
    );
    assert!(first_error(&dup).contains("duplicate budget name"));
    let none = format!("{BASE}plans:\n  pro:\n    max_delay: 1s\n");
    assert!(first_error(&none).starts_with("plans.pro.max_cost: is required"));
}

#[test]
fn named_upstreams_and_their_endpoints() {
    let ok = format!(
        "{BASE}upstreams:\n  gh: {{ url: \"https://boards-api.greenhouse.io\" }}\n  pool:\n    urls: [\"http://10.0.0.5:8000\", \"http://10.0.0.6:8000\"]\n    health_check: {{ path: /healthz, interval: 5s }}\n"
    )
    .replace(
        "    \"GET /reports/{id}\":\n      cost: 1\n",
        "    \"GET /reports/{id}\":\n      cost: 1\n    \"/gh/{*rest}\":\n      upstream: gh\n      strip_prefix: /gh\n      shared: { max_cost: 2, window: 1s, max_delay: 30s }\n",
    );
    let c = parse(&ok).unwrap();
    assert_eq!(c.upstreams["pool"].targets.len(), 2);
    assert!(c.upstreams["gh"].targets[0].tls);
    let route = c.router.classify("GET", "/gh/v1/boards").route.clone();
    assert_eq!(route.provider.upstream.as_deref(), Some("gh"));
    assert_eq!(route.shared().map(|b| b.max_cost), Some(2));

    let unknown = ok.replace("upstream: gh", "upstream: nope");
    assert_eq!(
        first_error(&unknown),
        "rate_limits.endpoints.\"/gh/{*rest}\".upstream: unknown upstream \"nope\" (not in upstreams)"
    );
    let both = ok.replace(
        "gh: { url: \"https://boards-api.greenhouse.io\" }",
        "gh: { url: \"http://a:1\", urls: [\"http://b:1\"] }",
    );
    assert_eq!(
        first_error(&both),
        "upstreams.gh: needs exactly one of url or urls"
    );
    let bad = ok.replace("http://10.0.0.6:8000", "ftp://x");
    assert!(first_error(&bad).starts_with("upstreams.pool.urls[1]:"));
    // Both of a health check's errors, not only the first.
    let check = ok.replace(
        "path: /healthz, interval: 5s",
        "path: healthz, interval: 0s",
    );
    let both: Vec<String> = parse(&check)
        .expect_err("refused")
        .0
        .iter()
        .map(|e| e.to_string())
        .filter(|e| e.starts_with("upstreams.pool.health_check"))
        .collect();
    assert_eq!(
        both,
        [
            "upstreams.pool.health_check.path: must start with /",
            "upstreams.pool.health_check.interval: must be greater than 0"
        ]
    );
    let prefix = ok.replace("strip_prefix: /gh", "strip_prefix: /other");
    assert!(first_error(&prefix).contains(".strip_prefix: must be a leading part"));
    // Part of a segment, or a template, is a prefix no request's path has: it never applied.
    for never in ["/g", "/gh/{*rest}"] {
        let partial = ok.replace("strip_prefix: /gh", &format!("strip_prefix: \"{never}\""));
        assert!(
            first_error(&partial).contains(".strip_prefix: must be a leading part"),
            "{never}: {}",
            first_error(&partial)
        );
    }
}

#[test]
fn shared_budgets_are_refused_on_redis_cluster() {
    let s = format!(
        "{BASE}store:\n  backend: redis\n  url: \"redis+cluster://127.0.0.1:7000,127.0.0.1:7001\"\n"
    )
    .replace(
        "    \"GET /reports/{id}\":\n      cost: 1\n",
        "    \"GET /reports/{id}\":\n      cost: 1\n    /provider:\n      shared: { max_cost: 2, window: 1s }\n",
    );
    assert_eq!(
        first_error(&s),
        "rate_limits.endpoints.\"/provider\".shared: a shared budget needs a single Redis node or Sentinel (not yet supported on Redis Cluster)"
    );
}

/// Two listeners on one port pass no `check` (they would fail `run` with "Address already in
/// use"): the same address twice, the admin port on a proxy port, "any address" beside a
/// specific one of the same family. Port 0 and different families do not clash.
#[test]
fn listeners_need_addresses_of_their_own() {
    let server = |body: &str| match parse(&format!("server:\n{body}\n{BASE}")) {
        Ok(_) => vec![],
        Err(e) => e.0.into_iter().map(|e| e.to_string()).collect::<Vec<_>>(),
    };
    assert_eq!(
        server("  listen: [\"127.0.0.1:31120\", \"127.0.0.1:31120\"]"),
        ["server.listen[1]: 127.0.0.1:31120 is taken by server.listen[0]: each listener needs an address of its own"]
    );
    assert_eq!(
        server("  listen: \"127.0.0.1:9000\"\n  admin_listen: \"127.0.0.1:9000\""),
        ["server.admin_listen: 127.0.0.1:9000 is taken by server.listen: each listener needs an address of its own"]
    );
    assert_eq!(
        server("  listen: [\"0.0.0.0:9000\", \"127.0.0.1:9000\"]").len(),
        1
    );
    assert!(server(
        "  listen: [\"127.0.0.1:0\", \"127.0.0.1:0\"]\n  admin_listen: \"127.0.0.1:0\""
    )
    .is_empty());
    assert!(server("  listen: [\"127.0.0.1:9000\", \"[::1]:9000\"]").is_empty());
    assert!(server("  listen: [\"127.0.0.1:9000\", \"127.0.0.2:9000\"]").is_empty());
}

/// `[::]` takes its port on IPv4 too where the host binds both families on it (Linux's
/// default, `net.ipv6.bindv6only` 0), and not where it binds IPv6 only: the rule on either
/// host, whichever this one is.
#[test]
fn an_ipv6_any_address_takes_the_port_on_ipv4_where_the_host_binds_both() {
    use super::super::validate::binds_same_port;
    let a = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
    for (x, y) in [
        ("[::]:9000", "127.0.0.1:9000"),
        ("0.0.0.0:9000", "[::]:9000"),
    ] {
        assert!(binds_same_port(a(x), a(y), true), "{x} {y}");
        assert!(!binds_same_port(a(x), a(y), false), "{x} {y}");
    }
    // Never a specific IPv6 address beside IPv4, nor another port, nor port 0.
    for dual in [true, false] {
        assert!(!binds_same_port(a("[::1]:9000"), a("0.0.0.0:9000"), dual));
        assert!(!binds_same_port(a("[::]:9000"), a("127.0.0.1:9001"), dual));
        assert!(!binds_same_port(a("[::]:0"), a("127.0.0.1:0"), dual));
    }
}
