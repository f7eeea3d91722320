//! The file as written: serde types whose field names and defaults are DESIGN §1.
//!
//! Nothing here is checked beyond its type; `validate` turns a [`RawConfig`] into a `Config`.
//! It is kept (serialized back) for `/admin/config`.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use serde::de::{DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::duration::ConfDuration;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    pub upstream: RawUpstream,
    /// Named upstreams besides `upstream` (the default), chosen per endpoint.
    #[serde(
        default,
        deserialize_with = "unique_keys",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub upstreams: BTreeMap<String, RawNamedUpstream>,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub identity: RawIdentity,
    pub rate_limits: RawRateLimits,
    #[serde(default, deserialize_with = "unique_keys")]
    pub plans: BTreeMap<String, RawPlan>,
    #[serde(default)]
    pub keys: Vec<RawKey>,
    /// OpenTelemetry traces (DESIGN §9); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<super::traces::RawTracing>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Listen {
    One(String),
    Many(Vec<String>),
}

impl Listen {
    pub fn addrs(&self) -> Vec<String> {
        match self {
            Listen::One(s) => vec![s.clone()],
            Listen::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    #[serde(default = "default_listen")]
    pub listen: Listen,
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    #[serde(default)]
    pub threads: Option<i64>,
    #[serde(default = "default_grace")]
    pub grace_period: ConfDuration,
    /// The whole request head must arrive within this (slowloris).
    #[serde(default = "default_header_timeout")]
    pub header_timeout: ConfDuration,
    /// Longest gap between two reads of a request body (then 408).
    #[serde(default = "default_body_timeout")]
    pub body_timeout: ConfDuration,
    /// Longest gap between two writes to a client that does not read.
    #[serde(default = "default_send_timeout")]
    pub send_timeout: ConfDuration,
    /// Open client connections per instance; more are refused at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: i64,
    /// TLS termination on a listener of its own (HTTP/2 offered by ALPN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RawTls>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub listen: String,
    /// PEM certificate chain, leaf first; re-read on reload.
    pub cert: String,
    /// PEM private key of the leaf certificate; re-read on reload.
    pub key: String,
}

fn default_listen() -> Listen {
    Listen::One("0.0.0.0:8080".into())
}
fn default_admin_listen() -> String {
    "127.0.0.1:9901".into()
}
fn default_grace() -> ConfDuration {
    ConfDuration(Duration::from_secs(10))
}
fn default_header_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(10))
}
fn default_body_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(30))
}
fn default_send_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(30))
}
fn default_max_connections() -> i64 {
    10_000
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            threads: None,
            grace_period: default_grace(),
            header_timeout: default_header_timeout(),
            body_timeout: default_body_timeout(),
            send_timeout: default_send_timeout(),
            max_connections: default_max_connections(),
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: String,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: ConfDuration,
    #[serde(default = "default_read_timeout")]
    pub read_timeout: ConfDuration,
    /// How long a capped slot follows a late upstream after the request was sent (default
    /// 10 × `read_timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandon_timeout: Option<ConfDuration>,
    /// PEM file of CA certificates to trust for an https upstream (default: the system's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
}

/// One of `upstreams:`: an address (`url`), or a pool (`urls`) balanced round robin.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawNamedUpstream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urls: Option<Vec<String>>,
    /// Active health checks: unhealthy addresses are skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<RawHealthCheck>,
    /// Default: `upstream.connect_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<ConfDuration>,
    /// Default: `upstream.read_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_timeout: Option<ConfDuration>,
    /// Default: `upstream.abandon_timeout` if set, else 10 × this upstream's `read_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandon_timeout: Option<ConfDuration>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    pub path: String,
    pub interval: ConfDuration,
}

fn default_connect_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(2))
}
fn default_read_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(60))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Memory,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    Local,
    Allow,
    Deny,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(default = "default_backend")]
    pub backend: Backend,
    #[serde(default = "default_redis_url")]
    pub url: String,
    #[serde(default = "default_store_timeout")]
    pub timeout: ConfDuration,
    #[serde(default = "default_on_error")]
    pub on_error: OnError,
    #[serde(default = "default_fleet_size")]
    pub fleet_size: i64,
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: ConfDuration,
    /// Budget slices (Redis): fewer round trips for busy keys; their units drain a little later.
    #[serde(default)]
    pub slices: bool,
}

fn default_backend() -> Backend {
    Backend::Memory
}
fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/0".into()
}
/// Above the slowest calls seen to a healthy local Redis under a burst on a loaded machine
/// (README, `store.timeout`), so that load alone does not open the breaker.
fn default_store_timeout() -> ConfDuration {
    ConfDuration(Duration::from_millis(250))
}
fn default_on_error() -> OnError {
    OnError::Local
}
fn default_fleet_size() -> i64 {
    1
}
fn default_lease_ttl() -> ConfDuration {
    ConfDuration(Duration::from_secs(15))
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            backend: default_backend(),
            url: default_redis_url(),
            timeout: default_store_timeout(),
            on_error: default_on_error(),
            fleet_size: default_fleet_size(),
            lease_ttl: default_lease_ttl(),
            slices: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Anonymous {
    Reject,
    ClientIp,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    #[serde(default = "default_sources")]
    pub sources: Vec<String>,
    #[serde(default = "default_anonymous")]
    pub anonymous: Anonymous,
    /// false: the key's header / `Authorization` is not sent upstream.
    #[serde(default = "default_forward_credentials")]
    pub forward_credentials: bool,
    /// A header that tells the upstream which key paid; "" = none.
    #[serde(default)]
    pub key_id_header: String,
    /// CIDRs of the proxies (load balancers) whose `X-Forwarded-For` names the client.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
}

fn default_sources() -> Vec<String> {
    vec!["header:x-api-key".into(), "bearer".into()]
}
fn default_anonymous() -> Anonymous {
    Anonymous::Reject
}
fn default_forward_credentials() -> bool {
    true
}

impl Default for RawIdentity {
    fn default() -> Self {
        Self {
            sources: default_sources(),
            anonymous: default_anonymous(),
            forward_credentials: default_forward_credentials(),
            key_id_header: String::new(),
            trusted_proxies: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    pub name: String,
    pub max_cost: i64,
    pub window: ConfDuration,
}

fn one() -> i64 {
    1
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct RawAsync {
    #[serde(default)]
    pub when: AsyncWhen,
    /// How long a finished job's response is kept (default 1h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_ttl: Option<ConfDuration>,
    /// A larger request body: 413 (default 1MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_body: Option<super::size::ConfSize>,
    /// A larger upstream answer ends the job failed (default 16MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_response_body: Option<super::size::ConfSize>,
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
#[serde(deny_unknown_fields)]
pub struct RawShared {
    pub max_cost: i64,
    pub window: ConfDuration,
    /// Hold callers in line this long at most (else 429).
    #[serde(default)]
    pub max_delay: ConfDuration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub id: String,
    pub sha256: String,
    #[serde(default)]
    pub plan: Option<String>,
}

/// A map in which a key may appear only once. serde's maps keep the last of two equal keys,
/// which would silently drop the first endpoint or plan of that name (DESIGN §1: an error).
fn unique_keys<'de, D, V>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(PhantomData<V>);

    impl<'de, V: Deserialize<'de>> Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a map")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                let value = map.next_value_seed(Value {
                    repeated: out.contains_key(&key),
                    value: PhantomData,
                })?;
                out.insert(key, value);
            }
            Ok(out)
        }
    }

    d.deserialize_map(Unique(PhantomData))
}

/// A map value, refused when its key was seen before. The refusal comes from inside the
/// value so that `serde_path_to_error` reports the path of the repeated key, and from a
/// visitor so that serde_yaml reports the line of the repeated entry (not of the map).
struct Value<V> {
    repeated: bool,
    value: PhantomData<V>,
}

impl<'de, V: Deserialize<'de>> DeserializeSeed<'de> for Value<V> {
    type Value = V;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<V, D::Error> {
        if self.repeated {
            return d.deserialize_any(Repeated(PhantomData));
        }
        V::deserialize(d)
    }
}

const REPEATED: &str = "appears twice in this map; each key may appear only once";

/// Refuses whatever value it is given.
struct Repeated<V>(PhantomData<V>);

macro_rules! refuse {
    ($($name:ident: $t:ty),*) => {
        $(fn $name<E: serde::de::Error>(self, _: $t) -> Result<V, E> {
            Err(E::custom(REPEATED))
        })*
    };
}

impl<'de, V> Visitor<'de> for Repeated<V> {
    type Value = V;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REPEATED)
    }

    refuse!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);

    fn visit_unit<E: serde::de::Error>(self) -> Result<V, E> {
        Err(E::custom(REPEATED))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<V, A::Error> {
        Err(serde::de::Error::custom(REPEATED))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<V, A::Error> {
        Err(serde::de::Error::custom(REPEATED))
    }
}
