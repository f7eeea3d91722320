//! `rate_limits:`, `plans:` and `keys:` as written: what a request costs and who pays how much.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::unique::unique_keys;
use crate::config::duration::ConfDuration;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "the rate-limit settings, a map with default, endpoints, plans, …"
)]
pub struct RawRateLimits {
    /// `enforce` (default) or `shadow`: decide and count, never refuse (DESIGN §6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    pub default: RawDefault,
    #[serde(default, deserialize_with = "unique_keys")]
    pub endpoints: BTreeMap<String, RawEndpoint>,
    /// Rails-style formats (`[".json", ".xml"]`): a path ending in one also matches the route
    /// without it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_suffixes: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "the default route's settings, a map like {cost: 1, window: 60s, max_cost: 120}"
)]
pub struct RawDefault {
    #[serde(default = "one")]
    pub cost: i64,
    /// With `max_cost`: the one budget; or `budgets` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<ConfDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<i64>,
    #[serde(default)]
    pub max_delay: ConfDuration,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<Vec<RawBudget>>,
}

/// One of several budgets (`budgets:` instead of `max_cost`/`window`): all must fit.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a budget, a map like {name: day, window: 24h, max_cost: 20000}"
)]
pub struct RawBudget {
    #[serde(deserialize_with = "super::text")]
    pub name: String,
    pub max_cost: i64,
    pub window: ConfDuration,
}

fn one() -> i64 {
    1
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an endpoint's settings, a map like {cost: 20}"
)]
pub struct RawEndpoint {
    /// Defaults to `rate_limits.default.cost`.
    #[serde(default)]
    pub cost: Option<i64>,
    #[serde(default)]
    pub max_in_flight: Option<i64>,
    #[serde(default)]
    pub queue_timeout: Option<ConfDuration>,
    /// Fleet-wide waiters for a slot; beyond it 503 `route-busy` at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<i64>,
    /// One key's share of the route's slots: its further requests wait (not refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight_per_key: Option<i64>,
    /// Bill measured upstream time: the final charge is `max(cost, ceil(s × this))`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_second: Option<f64>,
    /// The upstream states the request's real cost in this response header; the charge
    /// settles on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_from_response: Option<String>,
    /// Overrides `rate_limits.mode` for this endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// One budget for every caller of this route, fleet-wide (a provider's own cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<RawShared>,
    /// Forward to this named upstream (of `upstreams:`) instead of `upstream`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// Remove this leading path prefix before forwarding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strip_prefix: Option<String>,
    /// RFC 7240 `Prefer: respond-async`: the request becomes a job (DESIGN §8).
    #[serde(default, rename = "async", skip_serializing_if = "Option::is_none")]
    pub jobs: Option<RawAsync>,
}

/// `async:` on an endpoint: when a request becomes a job, and the job's bounds.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "the async settings, a map like {when: prefer, result_ttl: 10m}"
)]
pub struct RawAsync {
    #[serde(default)]
    pub when: AsyncWhen,
    /// How long a finished job's response is kept (default 1h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_ttl: Option<ConfDuration>,
    /// A larger request body: 413 (default 1MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_body: Option<crate::config::size::ConfSize>,
    /// A larger upstream answer ends the job failed (default 16MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_response_body: Option<crate::config::size::ConfSize>,
}

/// `async.when`: the client asks (`Prefer: respond-async`), or every request is a job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AsyncWhen {
    #[default]
    Prefer,
    Always,
}

/// Whether a route's refusals are enforced, or only counted (`shadow`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Enforce,
    Shadow,
}

/// `shared:` on an endpoint: a budget all callers of the route draw from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a shared budget, a map like {window: 60s, max_cost: 100}"
)]
pub struct RawShared {
    pub max_cost: i64,
    pub window: ConfDuration,
    /// Hold callers in line this long at most (else 429).
    #[serde(default)]
    pub max_delay: ConfDuration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, expecting = "a plan's settings, a map")]
pub struct RawPlan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<ConfDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<Vec<RawBudget>>,
    #[serde(default)]
    pub max_delay: Option<ConfDuration>,
    #[serde(default)]
    pub max_in_flight_per_key: Option<i64>,
    /// The plan's share of a full capped route's slots (default 1), DESIGN §8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a key, a map like {id: acme, sha256: \"…\"}"
)]
pub struct RawKey {
    #[serde(deserialize_with = "super::text")]
    pub id: String,
    #[serde(deserialize_with = "super::text")]
    pub sha256: String,
    #[serde(default)]
    pub plan: Option<String>,
}
