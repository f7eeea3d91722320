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

/// Every error `check` reports for `s`, in its order.
fn all_errors(s: &str) -> Vec<String> {
    let errs = parse(s).expect_err("config should be rejected").0;
    errs.iter().map(|e| e.to_string()).collect()
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

/// The default store timeout stays above a loaded machine's slowest calls to a healthy local
/// Redis (README, `store.timeout`: up to 250 ms seen under a burst on 2 oversubscribed cores),
/// so a burst alone does not open the breaker.
#[test]
fn the_default_store_timeout_outlasts_a_burst() {
    let c = parse(BASE).unwrap();
    assert_eq!(c.store.timeout, Duration::from_millis(250));
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

/// A YAML syntax error further down than an unknown key is reported beside it: the typed
/// parse stops at the key, before the text is read to its end, and `check` said only the key.
#[test]
fn a_syntax_error_after_an_unknown_key_is_reported_too() {
    let s = format!("{BASE}server:\n  bogus: 1\ntracing:\n  service_name: x\n   sample_ratio: 1\n");
    let errs = all_errors(&s);
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(
        errs[0].starts_with("server.bogus: unknown field `bogus`"),
        "{errs:?}"
    );
    assert!(
        errs[1].starts_with("tracing: mapping values are not allowed in this context at line"),
        "{errs:?}"
    );
    // A syntax error alone is said once.
    let s = format!("{BASE}tracing:\n  service_name: x\n   sample_ratio: 1\n");
    assert_eq!(all_errors(&s).len(), 1);
}

/// A byte order mark before the first key (some editors write one) is not part of the
/// document: it said "missing field `upstream` at line 1 column 2".
#[test]
fn a_byte_order_mark_is_not_part_of_the_document() {
    let with_bom = format!("\u{feff}{}", BASE.trim_start());
    assert!(parse(&with_bom).is_ok(), "{:?}", parse(&with_bom).err());
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

/// YAML's null in a string field is no value, not the text `null` or `~`: refused where a
/// string is needed (it made a key id "null", a header named `~`), off where "" is off.
#[test]
fn a_null_string_is_no_value() {
    let key = "keys:\n  - {id: ID, sha256: \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}\n";
    for null in ["null", "~", ""] {
        let e = first_error(&format!("{BASE}{}", key.replace("ID", null)));
        assert!(
            e.starts_with("keys[0].id: no value given, expected a string"),
            "{null}: {e}"
        );
        let e = first_error(&BASE.replace("\"http://127.0.0.1:3000\"", null));
        assert!(
            e.starts_with("upstream.url: no value given, expected a string"),
            "{null}: {e}"
        );
        let c = parse(&format!("{BASE}identity:\n  key_id_header: {null}\n")).unwrap();
        assert_eq!(c.key_id_header, None, "{null}");
    }
    // One with a default: null is the default, which the environment may replace.
    let env = EnvOverrides {
        redis_url: Some("redis://10.0.0.1:6379/0".into()),
        fleet_size: None,
    };
    for null in ["null", "~", ""] {
        let c = Config::parse(&format!("{BASE}store:\n  url: {null}\n"), &env).unwrap();
        assert_eq!(c.store.url, "redis://10.0.0.1:6379/0", "{null}");
        let c = parse(&format!("{BASE}store:\n  url: {null}\n")).unwrap();
        assert_eq!(c.store.url, "redis://127.0.0.1:6379/0", "{null}");
    }
    // Other scalars are strings as written.
    let c = parse(&format!("{BASE}{}", key.replace("ID", "0123"))).unwrap();
    assert_eq!(&*c.keys.values().next().unwrap().id, "0123");
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
    // A second entry with the same id and key is reported beside the unknown plan.
    let twice = format!(
        "{bad}  - id: acme-prod\n    sha256: \"{}\"\n",
        "ab".repeat(32)
    );
    assert_eq!(
        all_errors(&twice),
        [
            "keys[0].plan: unknown plan \"gold\"",
            "keys[1].sha256: duplicate key",
            "keys[1].id: duplicate id \"acme-prod\""
        ]
    );
    // A plan that is there but wrong is reported where it is wrong, not as unknown to its keys.
    let bad = s.replace("max_cost: 600", "max_cost: 0");
    assert_eq!(
        all_errors(&bad),
        ["plans.enterprise.max_cost: must be a positive integer, got 0"]
    );
}

#[test]
fn plan_names_fit_in_headers() {
    let s = format!("{BASE}\nplans:\n  \"gold plan\": {{max_cost: 600, window: 60s}}\n");
    assert!(first_error(&s).starts_with("plans.\"gold plan\": a plan name uses only"));
    let s = format!("{BASE}\nplans:\n  default: {{max_cost: 600, window: 60s}}\n");
    assert!(first_error(&s).starts_with("plans.default: a plan name"));
    // Nor the name a route's shared budget has beside the key's in the same headers.
    let s = format!("{BASE}\nplans:\n  shared: {{max_cost: 600, window: 60s}}\n");
    assert!(first_error(&s).starts_with("plans.shared: a plan name"));
}

/// A listen address that is neither a string nor a list says what it should be, not the
/// name of an internal type; a fleet size out of range from the environment says so.
#[test]
fn listen_and_environment_errors_say_what_they_need() {
    for v in ["7460", "null", "{a: 1}"] {
        let e = first_error(&format!("server:\n  listen: {v}\n{BASE}"));
        assert!(
            e.starts_with(
                "server.listen: expected an address like \"0.0.0.0:8080\", or a list of them"
            ),
            "{v}: {e}"
        );
    }
    let env = EnvOverrides {
        redis_url: None,
        fleet_size: Some("0".into()),
    };
    let e = Config::parse(BASE, &env).unwrap_err().0[0].to_string();
    assert_eq!(
        e,
        "store.fleet_size: must be an integer between 1 and 10000, got 0 (from TOLLGATE_FLEET_SIZE)"
    );
}

/// A pattern over YAML's 1,024 characters for a plain key cannot be read as one: the error
/// names the endpoints, not the entry above it (it said `"/exports/bulk"."?"`), and YAML's
/// explicit key (`? pattern`, then `: settings`) holds one up to the 2,048 the check allows.
#[test]
fn a_key_the_scanner_cannot_read_is_placed_in_its_map() {
    let long = format!("/{}", "x".repeat(1100));
    let s = format!("{BASE}    {long}:\n      cost: 2\n");
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.endpoints: could not find expected ':' at line 21"),
        "{e}"
    );
    let c = parse(&format!("{BASE}    ? {long}\n    : {{cost: 2}}\n")).unwrap();
    assert_eq!(c.router.route_of("GET", &long).unwrap().cost, 2);
    // After an entry in flow style: the endpoints too.
    let s = format!("{BASE}    /flow: {{cost: 3}}\n    {long}: {{cost: 2}}\n");
    let e = first_error(&s);
    assert!(
        e.starts_with("rate_limits.endpoints: could not find"),
        "{e}"
    );
    // A key the scanner cannot read inside an entry's own map names that entry.
    let s = BASE.replace(
        "    max_delay: 0s\n",
        "    max_delay 0s\n    max_cost: 120\n",
    );
    let e = first_error(&s);
    assert!(e.starts_with("rate_limits.default: could not find"), "{e}");
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
    // The effective default, 10 × read_timeout, written out (it was left out).
    assert_eq!(c.upstream.read_timeout, std::time::Duration::from_secs(60));
    assert!(y.contains("\n  abandon_timeout: 10m\n"), "{y}");
    assert!(y.contains("redis://:***@10.0.0.1:6379/0"), "{y}");
    assert_eq!(redact_url("redis://u:p@h:1/0"), "redis://u:***@h:1/0");
    // A password holding '?' or '#' is user information all the same; a query's values go.
    assert_eq!(
        redact_url("redis://:pa?ss@h:6379/0"),
        "redis://:***@h:6379/0"
    );
    assert_eq!(
        redact_url("redis://u:ab#cd@h/0?x=1"),
        "redis://u:***@h/0?x=***"
    );
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
        // Raw non-ASCII: requests are matched with it escaped.
        ("/prices/€", "/prices/%E2%82%AC"),
        ("/café/{id}", "/caf%C3%A9/{id}"),
        ("GET /a/%67", "GET /a/g"),
        // One space after the method: the pattern names the route in metrics and logs.
        ("GET  /dd", "GET /dd"),
        ("POST   /a//b", "POST /a/b"),
        ("/a/%67/{id}", "/a/g/{id}"),
        ("/x//{*rest}", "/x/{*rest}"),
        ("/x/{id}/..", "/x"),
        // Escaped ':' and sub-delimiters: requests are matched with them as they are.
        ("/v1/x%3Agenerate", "/v1/x:generate"),
        ("/a%2bb%40c", "/a+b@c"),
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
        "/v1/{name}:generate",
        "/a%3Bb",
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
        "/q|x",
        "/a\"b",
        "/a^b",
        "/a[b]",
        "/a{{b",
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
    // Brackets inside quotes and comments are not nesting (the pattern is refused for what
    // it is: a path holds '[' percent-encoded).
    let s = format!(
        "{BASE}    \"/q[{}]\":\n      cost: 2\n# {}\n",
        "[".repeat(70),
        "{".repeat(70)
    );
    assert!(first_error(&s).contains("write %5B"), "{}", first_error(&s));
}

mod messages;
mod sections;
mod store_url;
mod tls;

#[test]
fn store_slices_are_off_unless_asked_for() {
    assert!(!parse(BASE).unwrap().store.slices);
    let on = format!("{BASE}store:\n  backend: redis\n  slices: true\n");
    assert!(parse(&on).unwrap().store.slices);
    let bad = format!("{BASE}store:\n  backend: redis\n  slices: often\n");
    let e = first_error(&bad);
    assert!(e.starts_with("store.slices: invalid"), "{e}");
}

/// A value in the wrong place may be a secret: a raw API key where the registry wants a map,
/// a Redis URL with its password where a word or the store's map is expected, a PEM block
/// where a path is. Errors name the field (and line) but do not repeat such a value; a short
/// plain word (a typo of a choice) is still quoted.
#[test]
fn errors_do_not_repeat_values_that_may_be_secrets() {
    const KEY: &str = "SEKRIT-API-7f3a9c";
    const URL: &str = "redis://:SEKRIT-REDIS-pw41@127.0.0.1:6379/0";
    let pem = "      -----BEGIN PRIVATE KEY-----\n      MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgw\n      -----END PRIVATE KEY-----";
    let files = [
        format!("{BASE}keys:\n  - {KEY}\n"),
        format!("{BASE}store: \"{URL}\"\n"),
        format!("{BASE}store:\n  backend: \"{URL}\"\n"),
        format!("{BASE}identity:\n  sources: [\"{KEY}\"]\n"),
        format!("server:\n  tls:\n    listen: \"127.0.0.1:8443\"\n    cert: /nonexistent/c.pem\n    key: |\n{pem}\n{BASE}"),
        format!("{KEY} {URL}\n"),
    ];
    for file in &files {
        let errs = all_errors(file).join("\n");
        assert!(!errs.contains("SEKRIT"), "{errs}");
        assert!(!errs.contains("MIIEvg"), "{errs}");
        assert!(errs.contains("a value of"), "{errs}");
    }
    let typo = first_error(&format!("{BASE}store:\n  backend: redsi\n"));
    assert!(typo.contains("`redsi`"), "{typo}");
}
