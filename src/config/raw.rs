//! The file as written: serde types whose field names and defaults are DESIGN §1.
//!
//! Nothing here is checked beyond its type; `validate` turns a [`RawConfig`] into a `Config`.
//! It is kept (serialized back) for `/admin/config`.

mod limits;
pub(super) mod unique;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration::ConfDuration;
use unique::unique_keys;

pub use limits::{
    AsyncWhen, Mode, RawAsync, RawBudget, RawDefault, RawEndpoint, RawKey, RawPlan, RawRateLimits,
    RawShared,
};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a gateway.yaml: a map with upstream, rate_limits, …"
)]
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
#[serde(
    untagged,
    expecting = "expected an address like \"0.0.0.0:8080\", or a list of them"
)]
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
#[serde(deny_unknown_fields, expecting = "the server settings, a map")]
pub struct RawServer {
    #[serde(default = "default_listen")]
    pub listen: Listen,
    #[serde(default = "default_admin_listen", deserialize_with = "admin_listen")]
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
    /// A client connection with no request in progress is closed after this (keep-alive).
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: ConfDuration,
    /// Open client connections per instance; more are refused at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: i64,
    /// TLS termination on a listener of its own (HTTP/2 offered by ALPN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RawTls>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, expecting = "the TLS settings, a map")]
pub struct RawTls {
    #[serde(deserialize_with = "text")]
    pub listen: String,
    /// PEM certificate chain, leaf first; re-read on reload.
    #[serde(deserialize_with = "text")]
    pub cert: String,
    /// PEM private key of the leaf certificate; re-read on reload.
    #[serde(deserialize_with = "text")]
    pub key: String,
}

/// A string field: YAML's null (`null`, `~`, or no value) is refused as the field's error,
/// not read as the text `null` or `~` (serde_yaml reads any plain scalar into a string).
/// Other scalars stay as written (`id: 0123` is `"0123"`).
pub(crate) fn text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Option::<String>::deserialize(d)?
        .ok_or_else(|| serde::de::Error::invalid_type(serde::de::Unexpected::Unit, &"a string"))
}

/// [`text`] for a field whose "" means off: null (no value, `null`, `~`) is off too.
fn text_or_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// [`text`] for a field with a default: null is no value, so the default (as before, a
/// `store.url` left empty may be filled by `TOLLGATE_REDIS_URL`, which replaces it).
fn text_or<'de, D: serde::Deserializer<'de>>(
    d: D,
    default: fn() -> String,
) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_else(default))
}

fn admin_listen<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    text_or(d, default_admin_listen)
}

fn redis_url<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    text_or(d, default_redis_url)
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
fn default_idle_timeout() -> ConfDuration {
    ConfDuration(Duration::from_secs(60))
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
            idle_timeout: default_idle_timeout(),
            max_connections: default_max_connections(),
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    deny_unknown_fields,
    expecting = "the upstream, a map like {url: \"http://127.0.0.1:3000\"}"
)]
pub struct RawUpstream {
    #[serde(deserialize_with = "text")]
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
#[serde(
    deny_unknown_fields,
    expecting = "an upstream, a map like {url: \"http://10.0.0.5:8080\"}"
)]
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
#[serde(deny_unknown_fields, expecting = "the health check settings, a map")]
pub struct RawHealthCheck {
    #[serde(deserialize_with = "text")]
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
#[serde(
    deny_unknown_fields,
    expecting = "the store settings, a map like {backend: redis, url: \"redis://127.0.0.1:6379\"}"
)]
pub struct RawStore {
    #[serde(default = "default_backend")]
    pub backend: Backend,
    #[serde(default = "default_redis_url", deserialize_with = "redis_url")]
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
#[serde(deny_unknown_fields, expecting = "the identity settings, a map")]
pub struct RawIdentity {
    #[serde(default = "default_sources")]
    pub sources: Vec<String>,
    #[serde(default = "default_anonymous")]
    pub anonymous: Anonymous,
    /// false: the key's header / `Authorization` is not sent upstream.
    #[serde(default = "default_forward_credentials")]
    pub forward_credentials: bool,
    /// A header that tells the upstream which key paid; "" = none.
    #[serde(default, deserialize_with = "text_or_empty")]
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
