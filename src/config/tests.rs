//! Parsing and validation as `tollgate check` sees them: whole files in, errors with paths out.

use super::url::parse_upstream_url;
use super::*;
use crate::route;

const BASE: &str = r#"
upstream:
  url: "http://127.0.0.1:3000"
rate_limits:
  default:
    cost: 1
    window: 60s
    max_cost: 120
    max_delay: 0s
  endpoints:
    /reports/generate:
      cost: 20
      max_in_flight: 5
      queue_timeout: 2s
    /exports/bulk:
      cost: 15
    /analytics/query:
      cost: 10
    "GET /reports/{id}":
      cost: 1
"#;

fn parse(s: &str) -> Result<Config, ConfigErrors> {
    Config::parse(s, &EnvOverrides::default())
}

fn first_error(s: &str) -> String {
    parse(s).expect_err("config should be rejected").0[0].to_string()
}

#[test]
fn incident_block_parses() {
    let c = parse(BASE).unwrap();
    assert_eq!(c.default_policy.max_cost, 120);
    assert_eq!(c.default_policy.window, Duration::from_secs(60));
    let m = c.router.classify("POST", "/reports/generate");
    assert_eq!(m.route.cost, 20);
    assert_eq!(m.route.max_in_flight, Some(5));
    assert_eq!(m.route.queue_timeout, Duration::from_secs(2));
    assert_eq!(c.listen, vec!["0.0.0.0:8080".to_string()]);
    assert_eq!(c.store.backend, Backend::Memory);
}

#[test]
fn zero_cost_names_the_field() {
    let s = BASE.replace("cost: 20", "cost: 0");
    assert_eq!(
        first_error(&s),
        "rate_limits.endpoints.\"/reports/generate\".cost: must be a positive integer, got 0"
    );
}

#[test]
fn unknown_field_is_rejected_with_path() {
    let s = BASE.replace("      cost: 15", "      cost: 15\n      weight: 3");
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.endpoints.\"/exports/bulk\".weight: unknown field `weight`"),
        "{e}"
    );
}

#[test]
fn type_error_has_path() {
    let s = BASE.replace("max_cost: 120", "max_cost: lots");
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.default.max_cost: invalid type"),
        "{e}"
    );
    let s = BASE.replace("window: 60s", "window: 60");
    let e = first_error(&s);
    assert!(e.starts_with("rate_limits.default.window: "), "{e}");
}

#[test]
fn cost_over_plan_is_rejected() {
    let s = format!("{BASE}\nplans:\n  small:\n    max_cost: 10\n    window: 60s\n");
    let errs = parse(&s).err().unwrap().0;
    let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert!(msgs.contains(&"rate_limits.endpoints.\"/reports/generate\".cost: cost 20 exceeds plans.small.max_cost 10: such a request could never pass".to_string()), "{msgs:?}");
    assert!(msgs
        .iter()
        .any(|m| m.starts_with("rate_limits.endpoints.\"/exports/bulk\".cost")));
    assert!(!msgs
        .iter()
        .any(|m| m.contains("/analytics/query\".cost: cost 10")));
}

#[test]
fn registry_and_plans() {
    let s = format!(
        "{BASE}\nplans:\n  enterprise:\n    max_cost: 600\n    window: 60s\n    max_in_flight_per_key: 10\nkeys:\n  - id: acme-prod\n    sha256: \"{}\"\n    plan: enterprise\n",
        "ab".repeat(32)
    );
    let c = parse(&s).unwrap();
    let e = c.keys.get(&[0xab; 32]).unwrap();
    assert_eq!(&*e.id, "acme-prod");
    assert_eq!(e.policy.name, "enterprise");
    assert_eq!(e.policy.max_in_flight_per_key, Some(10));

    let bad = s.replace(&"ab".repeat(32), "secret-key");
    assert!(first_error(&bad).starts_with("keys[0].sha256: must be the 64 hex digits"));
    let bad = s.replace("plan: enterprise", "plan: gold");
    assert_eq!(first_error(&bad), "keys[0].plan: unknown plan \"gold\"");
}

#[test]
fn plan_names_fit_in_headers() {
    let s = format!("{BASE}\nplans:\n  \"gold plan\": {{max_cost: 600, window: 60s}}\n");
    assert!(first_error(&s).starts_with("plans.\"gold plan\": a plan name uses only"));
    let s = format!("{BASE}\nplans:\n  default: {{max_cost: 600, window: 60s}}\n");
    assert!(first_error(&s).starts_with("plans.default: a plan name"));
}

#[test]
fn env_overrides_and_redaction() {
    let env = EnvOverrides {
        redis_url: Some("redis://:hunter2@10.0.0.1:6379/0".into()),
        fleet_size: Some("6".into()),
    };
    let c = Config::parse(BASE, &env).unwrap();
    assert_eq!(c.store.fleet_size, 6);
    assert_eq!(c.store.url, "redis://:hunter2@10.0.0.1:6379/0");
    let y = c.redacted_yaml();
    assert!(!y.contains("hunter2"), "{y}");
    assert!(y.contains("redis://:***@10.0.0.1:6379/0"), "{y}");
    assert_eq!(redact_url("redis://u:p@h:1/0"), "redis://u:***@h:1/0");
    assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
    assert_eq!(
        redact_url("rediss+cluster://u:pw@h1:1,h2:2"),
        "rediss+cluster://u:***@h1:1,h2:2"
    );
    assert_eq!(
        redact_url("redis+sentinel://:pw@s1:1,s2:2/mymaster"),
        "redis+sentinel://:***@s1:1,s2:2/mymaster"
    );
}

#[test]
fn upstream_urls() {
    assert_eq!(
        parse_upstream_url("https://api.example.com").unwrap(),
        (true, "api.example.com".into(), 443)
    );
    assert_eq!(
        parse_upstream_url("http://127.0.0.1:3000/").unwrap(),
        (false, "127.0.0.1".into(), 3000)
    );
    assert!(parse_upstream_url("ftp://x").is_err());
    assert!(parse_upstream_url("http://x/api").is_err());
    let s = BASE.replace("http://127.0.0.1:3000", "tcp://x");
    assert!(first_error(&s).starts_with("upstream.url: must start with http://"));
    // A password in the URL is refused without being echoed.
    let s = BASE.replace(
        "http://127.0.0.1:3000",
        "http://user:hunter2@127.0.0.1:3000",
    );
    let e = first_error(&s);
    assert!(
        e.starts_with("upstream.url: credentials in the upstream URL"),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "{e}");
}

#[test]
fn identity_sources() {
    let s = format!("{BASE}\nidentity:\n  sources: [\"bearer\", \"header:X-Key\", \"cookie\"]\n");
    assert_eq!(
        first_error(&s),
        "identity.sources[2]: expected \"header:<name>\" or \"bearer\", got \"cookie\""
    );
}

#[test]
fn listen_list() {
    let s = format!("server:\n  listen: [\"127.0.0.1:1\", \"nope\"]\n{BASE}");
    assert_eq!(
        first_error(&s),
        "server.listen[1]: expected IP:PORT, got \"nope\""
    );
}

fn with_redis(url: &str) -> String {
    format!("store:\n  backend: redis\n  url: \"{url}\"\n{BASE}")
}

#[test]
fn store_url_must_parse() {
    for url in [
        "redis://127.0.0.1:6379/abc",
        "redis://[::1",
        "redis://:99999",
        "redis://127.0.0.1:0",
        "redis://127.0.0.1:6379/-1",
        "redis://",
        "redis://0.0.0.0:6379",
        "http://127.0.0.1:6379",
    ] {
        let e = first_error(&with_redis(url));
        assert!(e.starts_with("store.url: "), "{url}: {e}");
    }
    for url in [
        "redis://127.0.0.1:6379/0",
        "redis://127.0.0.1",
        "redis://[::1]:6379",
        "rediss://user:pw@cache.internal:6380/2",
        "redis://:pw@localhost:6379/15",
    ] {
        let c = parse(&with_redis(url)).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(c.store.url, url);
    }
    // The memory backend never connects: its url is not looked at.
    assert!(parse(&format!("store:\n  url: \"redis://[::1\"\n{BASE}")).is_ok());
}

#[test]
fn store_url_errors_never_show_the_password() {
    let e = first_error(&with_redis("redis://:hunter2@127.0.0.1:6379/abc"));
    assert!(e.starts_with("store.url: "), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
    let e = first_error(&with_redis("redis://u:hunter2@[::1:6379/0"));
    assert!(
        e.starts_with("store.url: ") && !e.contains("hunter2"),
        "{e}"
    );
}

#[test]
fn store_url_from_env_is_checked_too() {
    let env = EnvOverrides {
        redis_url: Some("redis://:hunter2@127.0.0.1:99999/0".into()),
        fleet_size: None,
    };
    let s = with_redis("redis://127.0.0.1:6379/0");
    let e = Config::parse(&s, &env).unwrap_err().0[0].to_string();
    assert!(e.starts_with("store.url: "), "{e}");
    assert!(e.contains("TOLLGATE_REDIS_URL"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
}

#[test]
fn cluster_and_sentinel_urls() {
    use super::url::{parse_redis_target, RedisTarget};
    assert_eq!(
        parse_redis_target("redis+cluster://10.0.0.1:7000,10.0.0.2").unwrap(),
        RedisTarget::Cluster {
            seeds: vec![
                "redis://10.0.0.1:7000".into(),
                "redis://10.0.0.2:6379".into()
            ]
        }
    );
    assert_eq!(
        parse_redis_target("rediss+cluster://:pw@[::1]:7000,h2:7001/").unwrap(),
        RedisTarget::Cluster {
            seeds: vec![
                "rediss://:pw@[::1]:7000".into(),
                "rediss://:pw@h2:7001".into()
            ]
        }
    );
    assert_eq!(
        parse_redis_target("rediss+sentinel://u:pw@s1,s2:5000/my-master/2").unwrap(),
        RedisTarget::Sentinel {
            sentinels: vec!["rediss://s1:26379".into(), "rediss://s2:5000".into()],
            master: "my-master".into(),
            primary: "rediss://u:pw@sentinel-named/2".into(),
        }
    );
    for url in [
        "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
        "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster",
        "rediss+cluster://:pw@10.0.0.1:6379",
    ] {
        let s = with_redis(url);
        assert!(Config::parse(&s, &EnvOverrides::default()).is_ok(), "{url}");
    }
    for (url, why) in [
        ("redis+cluster://h1:6379,,h2:6379", "needs a host"),
        ("redis+cluster://:pw@h1:6379,h2:0", "port"),
        ("redis+cluster://h1:6379/3", "only database 0"),
        ("redis+cluster://h1:6379?x=1", "no query"),
        ("redis+sentinel://:pw@h1:26379", "name the master"),
        ("redis+sentinel://h1:26379/a b", "name the master"),
        ("redis+sentinel://:pw@h1:26379/m/x", "database"),
        ("redis+clusterx://h1", "must start with"),
    ] {
        let e = first_error(&with_redis(url));
        assert!(
            e.starts_with("store.url: ") && e.contains(why),
            "{url}: {e}"
        );
        assert!(!e.contains(":pw@"), "{e}");
    }
}

#[test]
fn a_key_twice_in_a_map_is_an_error() {
    let s = BASE.replace(
        "    /analytics/query:\n      cost: 10\n",
        "    /analytics/query:\n      cost: 10\n    /exports/bulk:\n      cost: 3\n",
    );
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.endpoints.\"/exports/bulk\": appears twice"),
        "{e}"
    );
    let s = format!(
        "{BASE}plans:\n  pro: {{max_cost: 600, window: 60s}}\n  free: {{max_cost: 60, window: 60s}}\n  pro: {{max_cost: 900, window: 60s}}\n"
    );
    let e = first_error(&s);
    assert!(e.starts_with("plans.pro: appears twice"), "{e}");
}

fn with_endpoint(pattern: &str) -> String {
    format!("{BASE}    \"{pattern}\":\n      cost: 2\n")
}

#[test]
fn patterns_must_be_written_normalized() {
    for (pattern, normalized) in [
        ("/a/%67", "/a/g"),
        ("/a//b", "/a/b"),
        ("/a/./b", "/a/b"),
        ("/a/../b", "/b"),
        ("/a/", "/a"),
        ("/a/%7e%41", "/a/~A"),
        ("/caf%c3%a9", "/caf%C3%A9"),
        ("GET /a/%67", "GET /a/g"),
        ("/a/%67/{id}", "/a/g/{id}"),
        ("/x//{*rest}", "/x/{*rest}"),
        ("/x/{id}/..", "/x"),
    ] {
        let e = first_error(&with_endpoint(pattern));
        let path = format!("rate_limits.endpoints.\"{pattern}\": ");
        assert!(e.starts_with(&path), "{pattern}: {e}");
        assert!(
            e.contains(&format!("write \"{normalized}\"")),
            "{pattern}: {e}"
        );
    }
    // Already normalized: accepted.
    for pattern in [
        "/a/g",
        "/caf%C3%A9",
        "/a%20b",
        "GET /a/{id}.json",
        "/x/{*rest}",
    ] {
        assert!(parse(&with_endpoint(pattern)).is_ok(), "{pattern}");
    }
}

#[test]
fn patterns_that_can_never_match_are_errors() {
    for pattern in [
        "/a%2Fb",
        "/a%5cb",
        "/a\\b",
        "/a%00",
        "/a%zz",
        "/a?b=1",
        "/a#b",
        "/a<b>",
        "/a`b",
        "CONNECT /x",
    ] {
        let e = first_error(&format!("{BASE}    '{pattern}':\n      cost: 2\n"));
        let path = super::error::key_path("rate_limits.endpoints", pattern);
        assert!(e.starts_with(&format!("{path}: ")), "{pattern}: {e}");
        assert!(e.contains("never"), "{pattern}: {e}");
    }
}

#[test]
fn huge_names_are_refused_with_a_short_error() {
    let long = "a".repeat(70_000);
    let s = format!("{BASE}plans:\n  ? {long}\n  : {{max_cost: 600, window: 60s}}\n");
    let e = first_error(&s);
    assert!(e.starts_with("plans.\"aaaa"), "{}", &e[..100]);
    assert!(e.contains("at most 128 characters"), "{}", &e[..200]);
    assert!(
        e.len() < 400,
        "the error does not repeat the name: {} bytes",
        e.len()
    );

    let s = format!("{BASE}    ? /{long}\n    :\n      cost: 2\n");
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.endpoints.\"/aaaa"),
        "{}",
        &e[..100]
    );
    assert!(e.contains("at most 2048 characters"), "{}", &e[..200]);
    assert!(e.len() < 400, "{} bytes", e.len());

    let s = format!(
        "{BASE}keys:\n  - id: {long}\n    sha256: \"{}\"\n    plan: {long}\n",
        "ab".repeat(32)
    );
    let errs = parse(&s).unwrap_err().0;
    assert_eq!(
        errs[0].path,
        "keys[0].id",
        "{}",
        &errs[0].to_string()[..100]
    );
    assert!(errs[0].message.contains("at most 128 characters"));
    assert!(errs.iter().all(|e| e.to_string().len() < 400));
}

#[test]
fn hostile_yaml_is_bounded_before_parsing() {
    let t = std::time::Instant::now();
    let e = first_error(&"[".repeat(100_000));
    assert!(e.starts_with(".: nested deeper than 64 levels"), "{e}");
    let e = first_error(&format!(
        "{BASE}x: {}{}\n",
        "{a: ".repeat(65),
        "}".repeat(65)
    ));
    assert!(e.starts_with(".: nested deeper than 64 levels"), "{e}");
    let e = first_error(&"- ".repeat(100_000));
    assert!(e.starts_with(".: nested deeper than 64 levels"), "{e}");
    let deep: String = (0..100)
        .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
        .collect();
    let e = first_error(&deep);
    assert!(e.starts_with(".: nested deeper than 64 levels"), "{e}");
    let e = first_error(&format!("{BASE}#{}\n", "x".repeat(5 << 20)));
    assert!(e.starts_with(".: the file is 5"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // What counts is what the YAML parser sees, whatever the quotes around it.
    let sneaky = format!("a: b '\nc: {}{}\n", "{a: ".repeat(100), "}".repeat(100));
    assert!(first_error(&sneaky).starts_with(".: nested deeper than 64 levels (line 2)"));
    // Brackets inside quotes and comments are not nesting.
    let s = format!(
        "{BASE}    \"/q[{}]\":\n      cost: 2\n# {}\n",
        "[".repeat(70),
        "{".repeat(70)
    );
    assert!(parse(&s).is_ok());
}

#[test]
fn edge_settings_have_design_defaults() {
    let c = parse(BASE).unwrap();
    assert_eq!(c.client_limits.header_timeout, Duration::from_secs(10));
    assert_eq!(c.client_limits.body_timeout, Duration::from_secs(30));
    assert_eq!(c.client_limits.send_timeout, Duration::from_secs(30));
    assert_eq!(c.client_limits.max_connections, 10_000);
    assert!(c.forward_credentials);
    assert_eq!(c.key_id_header, None);
    let y = c.redacted_yaml();
    for field in [
        "header_timeout: 10s",
        "body_timeout: 30s",
        "send_timeout: 30s",
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
        "server:\n  header_timeout: 2s\n  body_timeout: 500ms\n  send_timeout: 1m\n  max_connections: 1\nidentity:\n  forward_credentials: false\n  key_id_header: X-Tollgate-Key-Id\n{BASE}"
    );
    let c = parse(&s).unwrap();
    assert_eq!(c.client_limits.header_timeout, Duration::from_secs(2));
    assert_eq!(c.client_limits.body_timeout, Duration::from_millis(500));
    assert_eq!(c.client_limits.send_timeout, Duration::from_secs(60));
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
    let route = |m: &str, p: &str| c.router.classify(m, p).route.fidelity;
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
fn final_cost_bills_time_but_never_less_than_cost() {
    let f = route::Fidelity {
        shadow: false,
        cost_per_second: Some(4.0),
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
    let prefix = ok.replace("strip_prefix: /gh", "strip_prefix: /other");
    assert!(first_error(&prefix).contains(".strip_prefix: must be a leading part"));
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

#[test]
fn a_password_with_a_slash_is_redacted_too() {
    assert_eq!(
        super::redact_url("redis://:pa/ss@h:6379/0"),
        "redis://:***@h:6379/0"
    );
    assert_eq!(
        super::redact_url("redis://u:p@h:6379/0"),
        "redis://u:***@h:6379/0"
    );
    assert_eq!(super::redact_url("redis://h:6379/0"), "redis://h:6379/0");
}
