//! gateway.yaml: parsed once at the edge into plain, validated values.
//!
//! The file format is the product contract (DESIGN §1). Parsing goes through `serde_path_to_error`
//! so that every error — a type error from serde or a rule checked afterwards — names its field
//! path, e.g. `rate_limits.endpoints."/reports/generate".cost: must be a positive integer, got 0`.
//! The rest of the gateway only ever sees a [`Config`], whose values are known to be usable.
//!
//! - [`raw`]: the file as written (serde types, DESIGN's defaults);
//! - [`duration`]: `250ms` / `10s` / `1m` / `1h`;
//! - [`error`]: errors that name their path;
//! - `url`: the upstream's and the store's URL; `pattern`: what an endpoint key must be;
//! - `bounds`: limits on file size, nesting and name lengths;
//! - `traces`: the `tracing:` block (OpenTelemetry export);
//! - `recover`: every error of a file, not only the first serde stops at;
//! - `validate`: one function per section, from [`RawConfig`] to [`Config`] (the budget
//!   sections, checked against each other, in `validate/budgets`);

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::route::Router;

mod bounds;
mod client_limits;
pub mod duration;
pub mod error;
pub mod origin;
mod pattern;
pub mod raw;
mod recover;
mod restart;
pub mod size;
mod traces;
mod url;
mod validate;

pub use crate::policy::Policy;
pub use bounds::read_bounded;
pub use client_limits::ClientLimits;
pub use duration::{format_duration, parse_duration, ConfDuration};
pub(crate) use error::shown_path;
pub use error::{ConfigError, ConfigErrors};
pub use raw::{
    Anonymous, Backend, Listen, Mode, OnError, RawBudget, RawConfig, RawDefault, RawEndpoint,
    RawIdentity, RawKey, RawPlan, RawRateLimits, RawServer, RawStore, RawTls, RawUpstream,
};
pub use traces::{RawTracing, TraceSettings};
pub use url::{parse_redis_target, redact_url, RedisTarget, StoreUrlError};

/// One entry of the key registry.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    pub id: Arc<str>,
    pub policy: Arc<Policy>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentitySource {
    /// A request header (parsed once here, so that a request's lookups hash it and no more).
    Header(http::HeaderName),
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
    /// How long a capped request's slot follows a late answer after the client got its 504,
    /// counted from when the request was sent.
    pub abandon_timeout: Duration,
    pub ca_file: Option<String>,
}

/// One of `upstreams:`: its addresses (one, or a pool) and optional health check.
#[derive(Debug, Clone)]
pub struct NamedUpstream {
    pub name: String,
    /// One per `url`/`urls` entry, in file order.
    pub targets: Vec<UpstreamTarget>,
    pub health_check: Option<HealthCheck>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: String,
    pub interval: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoreSettings {
    pub backend: Backend,
    pub url: String,
    pub timeout: Duration,
    pub on_error: OnError,
    pub fleet_size: u32,
    pub lease_ttl: Duration,
    /// `store.slices`: busy keys reserve slices of their budgets (`store::redis::slices`).
    pub slices: bool,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Vec<String>,
    pub admin_listen: String,
    pub threads: usize,
    pub grace_period: Duration,
    /// `server.header_timeout`, `body_timeout`, `send_timeout`, `idle_timeout` and
    /// `max_connections`: what the front door enforces on client connections.
    pub client_limits: ClientLimits,
    /// `server.tls`, with the certificate and key already read (they are re-read on reload).
    pub tls: Option<crate::tls::TlsListener>,
    pub upstream: UpstreamTarget,
    /// `upstreams:`, by name.
    pub upstreams: HashMap<String, Arc<NamedUpstream>>,
    pub store: StoreSettings,
    pub sources: Vec<IdentitySource>,
    pub anonymous: Anonymous,
    /// `identity.trusted_proxies`: peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: origin::TrustedProxies,
    /// `identity.forward_credentials`: false = the key's header / `Authorization` is removed
    /// before the request goes upstream.
    pub forward_credentials: bool,
    /// `identity.key_id_header`, lower-cased: send the paying key's id upstream in this
    /// header (and drop a client's copy). `None` when the file says "".
    pub key_id_header: Option<http::HeaderName>,
    pub default_policy: Arc<Policy>,
    pub plans: HashMap<String, Arc<Policy>>,
    /// sha256 of the key → registry entry.
    pub keys: HashMap<[u8; 32], KeyEntry>,
    /// Registry ids, for `/admin/keys/{id}`.
    pub key_ids: HashMap<String, [u8; 32]>,
    pub router: Router,
    /// `tracing:` with an endpoint: spans are built and exported (`None`: no spans at all).
    /// Its `sample_ratio` is reloaded; the rest takes effect on restart.
    pub tracing: Option<TraceSettings>,
    /// The file as parsed, for `/admin/config`.
    pub raw: RawConfig,
    /// The first 16 hex digits of the file's SHA-256 (`tollgate_config_info{hash}`), so an
    /// operator can tell which file each instance runs (`sha256sum gateway.yaml`).
    pub hash: String,
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

impl Config {
    pub fn load(path: &Path, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        let cannot_read = |e: std::io::Error| {
            ConfigErrors::one(path.display().to_string(), format!("cannot read: {e}"))
        };
        // Refuse a huge file before reading it into memory; one whose size is not known
        // before it is read, at the bound.
        bounds::check_size(std::fs::metadata(path).map_err(cannot_read)?.len())?;
        let bytes = bounds::read_bounded(path).map_err(cannot_read)?;
        if bytes.len() as u64 > bounds::MAX_FILE_BYTES {
            return Err(ConfigErrors::one(
                ".",
                "the file is more than the 4 MiB a gateway.yaml may have",
            ));
        }
        let text = String::from_utf8(bytes).map_err(|_| {
            cannot_read(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "stream did not contain valid UTF-8",
            ))
        })?;
        Self::parse(&text, env)
    }

    pub fn parse(text: &str, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        // A UTF-8 byte order mark (some editors write one) is not part of the document.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        // serde_yaml's time grows badly with nesting: bound the work before it starts.
        bounds::check_size(text.len() as u64)?;
        bounds::check_depth(text)?;
        let de = serde_yaml::Deserializer::from_str(text);
        let recover::Recovered {
            raw,
            errors,
            masked,
        } = match serde_path_to_error::deserialize::<_, RawConfig>(de) {
            Ok(raw) => return Self::validate(raw, env).map(|cfg| cfg.hashed(text)),
            Err(e) => recover::every_error(text, e)?,
        };
        // The file's own mistakes first (in the order the parse met them), then what
        // validation finds in the rest.
        let mut errors = errors.0;
        if let Err(errs) = Self::validate(raw, env) {
            errors.extend(errs.0.into_iter().filter(|e| masked.shows(e)));
        }
        Err(ConfigErrors(errors))
    }

    fn hashed(mut self, text: &str) -> Config {
        self.hash = {
            use sha2::Digest;
            hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8])
        };
        self
    }

    /// Checks every rule of DESIGN §1 and reports every problem found, not only the first.
    pub fn validate(raw: RawConfig, env: &EnvOverrides) -> Result<Config, ConfigErrors> {
        validate::validate(raw, env)
    }

    /// The effective configuration as YAML with secrets (Redis password) redacted, and the
    /// defaults worked out from other fields written out.
    pub fn redacted_yaml(&self) -> String {
        let mut raw = self.raw.clone();
        raw.store.url = redact_url(&self.store.url);
        raw.upstream.abandon_timeout = Some(duration::ConfDuration(self.upstream.abandon_timeout));
        serde_yaml::to_string(&raw).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
