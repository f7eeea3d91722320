//! Parsing and validation as `tollgate check` sees them: whole files in, errors with paths out.

use super::url::parse_upstream_url;
use super::*;

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
