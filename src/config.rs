//! gateway.yaml: parsed once at the edge into plain, validated values.
//!
//! The file format is the product contract (DESIGN §1). Parsing goes through `serde_path_to_error`
//! so that every error — a type error from serde or a rule checked afterwards — names its field
//! path, e.g. `rate_limits.endpoints."/reports/generate".cost: must be a positive integer, got 0`.
//! The rest of the gateway only ever sees a [`Config`], whose values are known to be usable.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::budget::Limit;
use crate::route::{RouteSpec, Router};

/// A configuration problem, always with the path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Every problem found in one file (validation does not stop at the first).
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Durations: "250ms", "10s", "1m", "1h".

/// A duration written as a string in gateway.yaml.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConfDuration(pub Duration);

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("expected a duration with a unit (ms, s, m, h), got \"{s}\""))?;
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("expected a duration like 250ms, 10s, 1m or 1h, got \"{s}\""))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => {
            return Err(format!(
                "unknown duration unit \"{unit}\" in \"{s}\" (use ms, s, m or h)"
            ))
        }
    };
    // Ten years is far beyond any sensible window and keeps microsecond math far from overflow.
    match ms {
        Some(ms) if ms <= 10 * 365 * 24 * 3_600_000 => Ok(Duration::from_millis(ms)),
        _ => Err(format!("duration \"{s}\" is too long")),
    }
}

pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        "0s".into()
    } else if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1_000) {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    }
}

impl<'de> Deserialize<'de> for ConfDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(ConfDuration)
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for ConfDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

// ---------------------------------------------------------------------------------------------
// The file as written. Field names and defaults are DESIGN §1.

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    pub upstream: RawUpstream,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub identity: RawIdentity,
    pub rate_limits: RawRateLimits,
    #[serde(default)]
    pub plans: BTreeMap<String, RawPlan>,
    #[serde(default)]
    pub keys: Vec<RawKey>,
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

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            threads: None,
            grace_period: default_grace(),
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
    /// PEM file of CA certificates to trust for an https upstream (default: the system's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
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
}

fn default_backend() -> Backend {
    Backend::Memory
}
fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/0".into()
}
fn default_store_timeout() -> ConfDuration {
    ConfDuration(Duration::from_millis(20))
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
}

fn default_sources() -> Vec<String> {
    vec!["header:x-api-key".into(), "bearer".into()]
}
fn default_anonymous() -> Anonymous {
    Anonymous::Reject
}

impl Default for RawIdentity {
    fn default() -> Self {
        Self {
            sources: default_sources(),
            anonymous: default_anonymous(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRateLimits {
    pub default: RawDefault,
    #[serde(default)]
    pub endpoints: BTreeMap<String, RawEndpoint>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefault {
    #[serde(default = "one")]
    pub cost: i64,
    pub window: ConfDuration,
    pub max_cost: i64,
    #[serde(default)]
    pub max_delay: ConfDuration,
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
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    pub max_cost: i64,
    pub window: ConfDuration,
    #[serde(default)]
    pub max_delay: Option<ConfDuration>,
    #[serde(default)]
    pub max_in_flight_per_key: Option<i64>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    pub id: String,
    pub sha256: String,
    #[serde(default)]
    pub plan: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// The validated configuration the gateway runs on.

/// A budget: the default one, or a plan's.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `default` or the plan's name; shown in `RateLimit-Policy`.
    pub name: String,
    pub max_cost: u64,
    pub window: Duration,
    pub max_delay: Duration,
    pub max_in_flight_per_key: Option<u32>,
    /// The GCRA parameters derived from the fields above.
    pub limit: Limit,
    /// Its `RateLimit-Policy` and `X-RateLimit-Limit` values, formatted once.
    pub headers: crate::problem::PolicyHeaders,
}

/// One entry of the key registry.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    pub id: Arc<str>,
    pub policy: Arc<Policy>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentitySource {
    /// A request header, lower-cased.
    Header(String),
    /// `Authorization: Bearer <key>`.
    Bearer,
}

#[derive(Debug, Clone)]
pub struct UpstreamTarget {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// `host:port` as it goes in the `Host` header (port omitted when it is the scheme's default).
    pub authority: String,
    /// `authority` as a header value, made once.
    pub host_header: http::HeaderValue,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub ca_file: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoreSettings {
    pub backend: Backend,
    pub url: String,
    pub timeout: Duration,
    pub on_error: OnError,
    pub fleet_size: u32,
    pub lease_ttl: Duration,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Vec<String>,
    pub admin_listen: String,
    pub threads: usize,
    pub grace_period: Duration,
    pub client_limits: crate::front::ClientLimits,
    pub upstream: UpstreamTarget,
    pub store: StoreSettings,
    pub sources: Vec<IdentitySource>,
    pub anonymous: Anonymous,
    pub default_policy: Arc<Policy>,
    pub plans: HashMap<String, Arc<Policy>>,
    /// sha256 of the key → registry entry.
    pub keys: HashMap<[u8; 32], KeyEntry>,
    /// Registry ids, for `/admin/keys/{id}`.
    pub key_ids: HashMap<String, [u8; 32]>,
    pub router: Router,
    /// The file as parsed, for `/admin/config`.
    pub raw: RawConfig,
}

/// Where the gateway's settings may be overridden from the environment (DESIGN §1).
#[derive(Debug, Clone, Default)]
pub struct EnvOverrides {
    pub redis_url: Option<String>,
    pub fleet_size: Option<String>,
}

impl EnvOverrides {
    pub fn from_env() -> Self {
        Self {
            redis_url: std::env::var("TOLLGATE_REDIS_URL")
                .ok()
                .filter(|s| !s.is_empty()),
            fleet_size: std::env::var("TOLLGATE_FLEET_SIZE")
                .ok()
                .filter(|s| !s.is_empty()),
        }
    }
}

/// Formats a serde path the way the errors of this module do: `a.b."/x/y".c[0]`.
fn format_path(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            serde_path_to_error::Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            serde_path_to_error::Segment::Map { key } => push_key(&mut out, key),
            serde_path_to_error::Segment::Enum { variant } => push_key(&mut out, variant),
            serde_path_to_error::Segment::Unknown => push_key(&mut out, "?"),
        }
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

fn push_key(out: &mut String, key: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        out.push_str(key);
    } else {
        out.push('"');
        out.push_str(&key.replace('"', "\\\""));
        out.push('"');
    }
}

fn key_path(prefix: &str, key: &str) -> String {
    let mut s = prefix.to_string();
    push_key(&mut s, key);
    s
}

impl Config {
    pub fn load(path: &Path, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![ConfigError::new(
                path.display().to_string(),
                format!("cannot read: {e}"),
            )])
        })?;
        Self::parse(&text, env)
    }

    pub fn parse(text: &str, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        let de = serde_yaml::Deserializer::from_str(text);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = format_path(e.path());
            let serde_style = e.path().to_string();
            // serde_yaml prefixes its own rendering of the path (replaced by ours) and appends
            // " at line L column C" (kept: it helps find the spot).
            let msg = e.into_inner().to_string();
            let msg = msg
                .strip_prefix(&format!("{serde_style}: "))
                .map(str::to_string)
                .unwrap_or_else(|| match msg.split_once(": ") {
                    Some((head, tail)) if !head.contains(' ') => tail.to_string(),
                    _ => msg.clone(),
                });
            ConfigErrors(vec![ConfigError::new(path, msg)])
        })?;
        Self::validate(raw, env)
    }

    pub fn validate(mut raw: RawConfig, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        let mut errs = Vec::new();
        let mut err = |p: String, m: String| errs.push(ConfigError::new(p, m));

        if let Some(url) = &env.redis_url {
            raw.store.url = url.clone();
        }
        if let Some(n) = &env.fleet_size {
            match n.trim().parse::<i64>() {
                Ok(n) => raw.store.fleet_size = n,
                Err(_) => err(
                    "TOLLGATE_FLEET_SIZE".into(),
                    format!("must be a positive integer, got \"{n}\""),
                ),
            }
        }

        // server
        let listen = raw.server.listen.addrs();
        if listen.is_empty() {
            err(
                "server.listen".into(),
                "at least one address is needed".into(),
            );
        }
        for (i, a) in listen.iter().enumerate() {
            if a.parse::<std::net::SocketAddr>().is_err() {
                let p = match raw.server.listen {
                    Listen::One(_) => "server.listen".to_string(),
                    Listen::Many(_) => format!("server.listen[{i}]"),
                };
                err(p, format!("expected IP:PORT, got \"{a}\""));
            }
        }
        if raw
            .server
            .admin_listen
            .parse::<std::net::SocketAddr>()
            .is_err()
        {
            err(
                "server.admin_listen".into(),
                format!("expected IP:PORT, got \"{}\"", raw.server.admin_listen),
            );
        }
        let threads = match raw.server.threads {
            None => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            Some(n) if (1..=1024).contains(&n) => n as usize,
            Some(n) => {
                err(
                    "server.threads".into(),
                    format!("must be between 1 and 1024, got {n}"),
                );
                1
            }
        };

        // upstream
        let upstream = match parse_upstream_url(&raw.upstream.url) {
            Ok((tls, host, port)) => {
                let default_port = if tls { 443 } else { 80 };
                let authority = if port == default_port {
                    host.clone()
                } else if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                Some(UpstreamTarget {
                    tls,
                    host,
                    port,
                    host_header: http::HeaderValue::from_str(&authority)
                        .unwrap_or_else(|_| http::HeaderValue::from_static("")),
                    authority,
                    connect_timeout: raw.upstream.connect_timeout.0,
                    read_timeout: raw.upstream.read_timeout.0,
                    ca_file: raw.upstream.ca_file.clone(),
                })
            }
            Err(m) => {
                err("upstream.url".into(), m);
                None
            }
        };
        if let Some(f) = &raw.upstream.ca_file {
            if let Err(e) = std::fs::metadata(f) {
                err(
                    "upstream.ca_file".into(),
                    format!("cannot read \"{f}\": {e}"),
                );
            }
        }
        if raw.upstream.connect_timeout.0.is_zero() {
            err(
                "upstream.connect_timeout".into(),
                "must be greater than 0".into(),
            );
        }
        if raw.upstream.read_timeout.0.is_zero() {
            err(
                "upstream.read_timeout".into(),
                "must be greater than 0".into(),
            );
        }

        // store
        if raw.store.backend == Backend::Redis
            && !(raw.store.url.starts_with("redis://") || raw.store.url.starts_with("rediss://"))
        {
            err(
                "store.url".into(),
                "must start with redis:// or rediss://".into(),
            );
        }
        if raw.store.timeout.0.is_zero() {
            err("store.timeout".into(), "must be greater than 0".into());
        }
        if raw.store.lease_ttl.0 < Duration::from_secs(1) {
            err("store.lease_ttl".into(), "must be at least 1s".into());
        }
        let fleet_size = if (1..=10_000).contains(&raw.store.fleet_size) {
            raw.store.fleet_size as u32
        } else {
            err(
                "store.fleet_size".into(),
                format!(
                    "must be an integer between 1 and 10000, got {}",
                    raw.store.fleet_size
                ),
            );
            1
        };

        // identity
        let mut sources = Vec::new();
        if raw.identity.sources.is_empty() {
            err(
                "identity.sources".into(),
                "at least one source is needed".into(),
            );
        }
        for (i, s) in raw.identity.sources.iter().enumerate() {
            if s == "bearer" {
                sources.push(IdentitySource::Bearer);
            } else if let Some(h) = s.strip_prefix("header:") {
                if h.is_empty() || http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                    err(
                        format!("identity.sources[{i}]"),
                        format!("invalid header name in \"{s}\""),
                    );
                } else {
                    sources.push(IdentitySource::Header(h.to_ascii_lowercase()));
                }
            } else {
                err(
                    format!("identity.sources[{i}]"),
                    format!("expected \"header:<name>\" or \"bearer\", got \"{s}\""),
                );
            }
        }

        // budgets
        let d = &raw.rate_limits.default;
        let default_policy = build_policy(
            "default",
            "rate_limits.default",
            d.max_cost,
            d.window.0,
            d.max_delay.0,
            None,
            &mut err,
        );
        if d.cost <= 0 {
            err(
                "rate_limits.default.cost".into(),
                format!("must be a positive integer, got {}", d.cost),
            );
        }
        let mut plans = HashMap::new();
        for (name, p) in &raw.plans {
            let base = key_path("plans", name);
            // Plan names go into RateLimit headers as structured-field strings.
            if name == "default"
                || name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                err(
                    base.clone(),
                    "a plan name uses only letters, digits, '-', '_' or '.', and is not \"default\" (that is rate_limits.default)".into(),
                );
            }
            let per_key = concurrency_cap(
                format!("{base}.max_in_flight_per_key"),
                p.max_in_flight_per_key,
                &mut err,
            );
            if let Some(policy) = build_policy(
                name,
                &base,
                p.max_cost,
                p.window.0,
                p.max_delay.map(|d| d.0).unwrap_or(d.max_delay.0),
                per_key,
                &mut err,
            ) {
                plans.insert(name.clone(), Arc::new(policy));
            }
        }

        // Every cost must fit every budget, or some request could never pass.
        let budgets: Vec<(String, u64)> =
            std::iter::once(("rate_limits.default".to_string(), d.max_cost))
                .chain(
                    raw.plans
                        .iter()
                        .map(|(n, p)| (key_path("plans", n), p.max_cost)),
                )
                .filter(|(_, m)| *m > 0)
                .map(|(n, m)| (n, m as u64))
                .collect();
        let check_fits = |path: String, cost: i64, err: &mut dyn FnMut(String, String)| {
            if cost <= 0 {
                return;
            }
            for (bname, max) in &budgets {
                if cost as u64 > *max {
                    err(
                        path.clone(),
                        format!("cost {cost} exceeds {bname}.max_cost {max}: such a request could never pass"),
                    );
                }
            }
        };
        check_fits("rate_limits.default.cost".into(), d.cost, &mut err);

        // endpoints
        let mut specs = Vec::new();
        for (pattern, e) in &raw.rate_limits.endpoints {
            let base = key_path("rate_limits.endpoints", pattern);
            let cost = e.cost.unwrap_or(d.cost);
            if cost <= 0 {
                err(
                    format!("{base}.cost"),
                    format!("must be a positive integer, got {cost}"),
                );
            }
            check_fits(format!("{base}.cost"), cost, &mut err);
            let max_in_flight =
                concurrency_cap(format!("{base}.max_in_flight"), e.max_in_flight, &mut err);
            if e.queue_timeout.is_some() && max_in_flight.is_none() {
                err(
                    format!("{base}.queue_timeout"),
                    "only applies together with max_in_flight".into(),
                );
            }
            specs.push(RouteSpec {
                pattern: pattern.clone(),
                cost: cost.max(1) as u64,
                max_in_flight,
                queue_timeout: e.queue_timeout.map(|d| d.0).unwrap_or_default(),
            });
        }
        let router = match Router::new(specs, d.cost.max(1) as u64) {
            Ok(r) => Some(r),
            Err(route_errs) => {
                for (pattern, m) in route_errs {
                    err(key_path("rate_limits.endpoints", &pattern), m);
                }
                None
            }
        };

        // key registry
        let mut keys = HashMap::new();
        let mut key_ids = HashMap::new();
        for (i, k) in raw.keys.iter().enumerate() {
            let base = format!("keys[{i}]");
            if k.id.is_empty()
                || !k
                    .id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                err(
                    format!("{base}.id"),
                    format!("must be non-empty and use only letters, digits, '-', '_' or '.', got \"{}\"", k.id),
                );
            }
            let hash = match hex::decode(k.sha256.trim()) {
                Ok(b) if b.len() == 32 => {
                    let mut h = [0u8; 32];
                    h.copy_from_slice(&b);
                    Some(h)
                }
                _ => {
                    err(
                        format!("{base}.sha256"),
                        "must be the 64 hex digits of the key's sha256 (raw keys never go in the config)".into(),
                    );
                    None
                }
            };
            let policy = match &k.plan {
                None => default_policy.clone().map(Arc::new),
                Some(p) => match plans.get(p) {
                    Some(pol) => Some(pol.clone()),
                    None => {
                        err(format!("{base}.plan"), format!("unknown plan \"{p}\""));
                        None
                    }
                },
            };
            if let (Some(hash), Some(policy)) = (hash, policy) {
                if keys.contains_key(&hash) {
                    err(format!("{base}.sha256"), "duplicate key".into());
                }
                if key_ids.insert(k.id.clone(), hash).is_some() {
                    err(format!("{base}.id"), format!("duplicate id \"{}\"", k.id));
                }
                keys.insert(
                    hash,
                    KeyEntry {
                        id: Arc::from(k.id.as_str()),
                        policy,
                    },
                );
            }
        }

        if !errs.is_empty() {
            return Err(ConfigErrors(errs));
        }
        let (Some(upstream), Some(default_policy), Some(router)) =
            (upstream, default_policy, router)
        else {
            // Unreachable: each None above pushed an error.
            return Err(ConfigErrors(vec![ConfigError::new(
                ".",
                "invalid configuration",
            )]));
        };
        // Registry entries without a plan share the default policy.
        let default_policy = Arc::new(default_policy);
        for entry in keys.values_mut() {
            if entry.policy.name == "default" {
                entry.policy = default_policy.clone();
            }
        }
        Ok(Config {
            listen,
            admin_listen: raw.server.admin_listen.clone(),
            threads,
            grace_period: raw.server.grace_period.0,
            client_limits: crate::front::ClientLimits::default(),
            upstream,
            store: StoreSettings {
                backend: raw.store.backend,
                url: raw.store.url.clone(),
                timeout: raw.store.timeout.0,
                on_error: raw.store.on_error,
                fleet_size,
                lease_ttl: raw.store.lease_ttl.0,
            },
            sources,
            anonymous: raw.identity.anonymous,
            default_policy,
            plans,
            keys,
            key_ids,
            router,
            raw,
        })
    }

    /// The effective configuration as YAML with secrets (Redis password) redacted.
    pub fn redacted_yaml(&self) -> String {
        let mut raw = self.raw.clone();
        raw.store.url = redact_url(&self.store.url);
        serde_yaml::to_string(&raw).unwrap_or_default()
    }
}

/// `redis://user:secret@host` → `redis://user:***@host`.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        None => url.to_string(),
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let redacted = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                "***".to_string()
            };
            format!("{}{}@{}", &url[..scheme_end + 3], redacted, &rest[at + 1..])
        }
    }
}

/// An optional in-flight cap: a positive integer up to a million.
fn concurrency_cap(
    path: String,
    value: Option<i64>,
    err: &mut dyn FnMut(String, String),
) -> Option<u32> {
    match value {
        Some(n) if (1..=1_000_000).contains(&n) => Some(n as u32),
        Some(n) => {
            err(
                path,
                format!("must be a positive integer (at most 1000000), got {n}"),
            );
            None
        }
        None => None,
    }
}

#[allow(clippy::too_many_arguments)]
fn build_policy(
    name: &str,
    base: &str,
    max_cost: i64,
    window: Duration,
    max_delay: Duration,
    max_in_flight_per_key: Option<u32>,
    err: &mut dyn FnMut(String, String),
) -> Option<Policy> {
    let mut ok = true;
    if max_cost <= 0 {
        err(
            format!("{base}.max_cost"),
            format!("must be a positive integer, got {max_cost}"),
        );
        ok = false;
    }
    if window.is_zero() {
        err(format!("{base}.window"), "must be greater than 0".into());
        ok = false;
    }
    if !ok {
        return None;
    }
    match Limit::new(max_cost as u64, window, max_delay) {
        Ok(limit) => Some(Policy {
            name: name.to_string(),
            max_cost: max_cost as u64,
            window,
            max_delay,
            max_in_flight_per_key,
            limit,
            headers: crate::problem::PolicyHeaders::new(name, max_cost as u64, window),
        }),
        Err(m) => {
            err(format!("{base}.max_cost"), m);
            None
        }
    }
}

/// `http://host[:port][/]` or `https://…` → (tls, host, port).
fn parse_upstream_url(url: &str) -> Result<(bool, String, u16), String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(format!(
            "must start with http:// or https://, got \"{url}\""
        ));
    };
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(format!(
            "expected scheme://host[:port] without a path, got \"{url}\""
        ));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let end = v6
            .find(']')
            .ok_or_else(|| format!("bad IPv6 address in \"{url}\""))?;
        let host = &v6[..end];
        let port = match &v6[end + 1..] {
            "" => default_port,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("bad port in \"{url}\""))?,
        };
        (host.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse().map_err(|_| format!("bad port in \"{url}\""))?,
            ),
            None => (authority.to_string(), default_port),
        }
    };
    if host.is_empty() {
        return Err(format!("missing host in \"{url}\""));
    }
    Ok((tls, host, port))
}

#[cfg(test)]
mod tests {
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
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("1d").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("99999999999999h").is_err());
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(120)), "2m");
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
        let s =
            format!("{BASE}\nidentity:\n  sources: [\"bearer\", \"header:X-Key\", \"cookie\"]\n");
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
}
