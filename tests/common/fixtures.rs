//! Configuration the tests share: the incident's rate limits, and keys as `keys:` names them.

/// A `keys:` entry for registry key `id`, whose raw key is `key-<id>`, with `extra` fields
/// (e.g. `", plan: gold"`).
pub fn registry_key(id: &str, extra: &str) -> String {
    format!(
        "  - {{id: {id}, sha256: \"{}\"{extra}}}\n",
        sha256_hex(&format!("key-{id}"))
    )
}

pub fn sha256_hex(key: &str) -> String {
    hex::encode(tollgate::identity::hash_key(key.as_bytes()))
}

/// The incident's rate limits with `/reports/generate` costing 1 and carrying `caps`
/// (indented endpoint lines, e.g. `"      max_in_flight: 2\n"`): for in-flight tests.
pub fn incident_with_report_caps(caps: &str) -> String {
    INCIDENT.replace("      cost: 20\n", &format!("      cost: 1\n{caps}"))
}

pub const INCIDENT: &str = r#"rate_limits:
  default:
    cost: 1
    window: 60s
    max_cost: 120
    max_delay: 0s
  endpoints:
    /reports/generate:
      cost: 20
    /exports/bulk:
      cost: 15
    /analytics/query:
      cost: 10
    "GET /reports/{id}":
      cost: 1
"#;

/// Registry keys `a`..`d` (raw keys `key-a`...), with `c` on plan `gold` and `d` on `basic` when
/// `plans` (a `plans:` section) is given, a 24 h budget (no refill within a test) and
/// `endpoint` (YAML lines under `endpoints:`).
pub fn four_keys(endpoint: &str, plans: &str) -> String {
    let keys: String = ["a", "b", "c", "d"]
        .iter()
        .map(|id| {
            let plan = match *id {
                "c" if !plans.is_empty() => ", plan: gold",
                "d" if !plans.is_empty() => ", plan: basic",
                _ => "",
            };
            registry_key(id, plan)
        })
        .collect();
    format!(
        "rate_limits:\n  default: {{cost: 1, window: 24h, max_cost: 1000}}\n  endpoints:\n{endpoint}{plans}keys:\n{keys}"
    )
}
