//! Who is paying: the API key of a request, hashed before it is used anywhere.
//!
//! The raw key is read from the configured sources, hashed with SHA-256 and dropped. Everything
//! downstream — the budget's store key, logs, metrics — sees only the hash, a registry id, or a
//! short hash prefix.

use std::net::IpAddr;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::config::{Anonymous, Config, IdentitySource};
use crate::policy::Policy;

/// SHA-256 of an API key (or of `ip:<addr>` for anonymous callers).
pub type KeyHash = [u8; 32];

pub fn hash_key(raw: &[u8]) -> KeyHash {
    Sha256::digest(raw).into()
}

/// A caller the gateway knows how to charge.
#[derive(Debug, Clone)]
pub struct Identity {
    pub hash: KeyHash,
    /// Registry id, when the key is in the registry.
    pub id: Option<Arc<str>>,
    pub policy: Arc<Policy>,
}

impl Identity {
    /// What logs may show: the registry id, or `key:` and 8 hex digits of the hash.
    pub fn log_name(&self) -> String {
        match &self.id {
            Some(id) => id.to_string(),
            None => format!("key:{}", hex::encode(&self.hash[..4])),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthenticated {
    /// No key, and `anonymous: reject`.
    Missing,
    /// A key that the (non-empty) registry doesn't know.
    Unknown,
}

/// Reads the key from the first source that has one.
pub fn extract_key<'a>(
    sources: &[IdentitySource],
    header: impl Fn(&str) -> Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    for s in sources {
        let v = match s {
            IdentitySource::Header(name) => header(name).map(trim_ascii),
            IdentitySource::Bearer => header("authorization").and_then(|v| {
                let v = trim_ascii(v);
                (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
                    .then(|| trim_ascii(&v[7..]))
            }),
        };
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            return Some(v);
        }
    }
    None
}

fn trim_ascii(v: &[u8]) -> &[u8] {
    v.trim_ascii()
}

/// Identifies a request from its key (if any) and client address.
pub fn identify(
    config: &Config,
    key: Option<&[u8]>,
    client: Option<IpAddr>,
) -> Result<Identity, Unauthenticated> {
    match key {
        Some(raw) => {
            let hash = hash_key(raw);
            if config.keys.is_empty() {
                return Ok(Identity {
                    hash,
                    id: None,
                    policy: config.default_policy.clone(),
                });
            }
            match config.keys.get(&hash) {
                Some(e) => Ok(Identity {
                    hash,
                    id: Some(e.id.clone()),
                    policy: e.policy.clone(),
                }),
                None => Err(Unauthenticated::Unknown),
            }
        }
        None => match (config.anonymous, client) {
            (Anonymous::ClientIp, Some(ip)) => Ok(Identity {
                hash: hash_key(format!("ip:{ip}").as_bytes()),
                id: None,
                policy: config.default_policy.clone(),
            }),
            _ => Err(Unauthenticated::Missing),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EnvOverrides;

    fn cfg(extra: &str) -> Config {
        let y = format!(
            "upstream: {{url: \"http://127.0.0.1:1\"}}\nrate_limits:\n  default: {{window: 60s, max_cost: 120}}\n{extra}"
        );
        Config::parse(&y, &EnvOverrides::default()).unwrap()
    }

    #[test]
    fn sources_in_order() {
        let sources = vec![
            IdentitySource::Header("x-api-key".into()),
            IdentitySource::Bearer,
        ];
        let h = |x: Option<&'static str>, a: Option<&'static str>| {
            move |n: &str| match n {
                "x-api-key" => x.map(str::as_bytes),
                "authorization" => a.map(str::as_bytes),
                _ => None,
            }
        };
        assert_eq!(
            extract_key(&sources, h(Some("k1"), Some("Bearer k2"))),
            Some(&b"k1"[..])
        );
        assert_eq!(
            extract_key(&sources, h(None, Some("Bearer k2"))),
            Some(&b"k2"[..])
        );
        assert_eq!(
            extract_key(&sources, h(None, Some("bearer  k2 "))),
            Some(&b"k2"[..])
        );
        assert_eq!(extract_key(&sources, h(Some(" "), Some("Basic abc"))), None);
        assert_eq!(extract_key(&sources, h(None, None)), None);
        let bearer_first = vec![sources[1].clone(), sources[0].clone()];
        assert_eq!(
            extract_key(&bearer_first, h(Some("k1"), Some("Bearer k2"))),
            Some(&b"k2"[..])
        );
    }

    #[test]
    fn registry_and_anonymous() {
        let open = cfg("");
        let id = identify(&open, Some(b"abc"), None).unwrap();
        assert_eq!(id.policy.name, "default");
        assert_eq!(id.log_name(), "key:ba7816bf");
        assert_eq!(
            identify(&open, None, None).unwrap_err(),
            Unauthenticated::Missing
        );

        let reg = cfg(&format!(
            "keys:\n  - {{id: acme, sha256: \"{}\"}}\nidentity: {{anonymous: client_ip}}\n",
            hex::encode(hash_key(b"secret"))
        ));
        assert_eq!(
            identify(&reg, Some(b"secret"), None).unwrap().log_name(),
            "acme"
        );
        assert_eq!(
            identify(&reg, Some(b"other"), None).unwrap_err(),
            Unauthenticated::Unknown
        );
        let ip = identify(&reg, None, Some("10.1.2.3".parse().unwrap())).unwrap();
        assert_eq!(ip.hash, hash_key(b"ip:10.1.2.3"));
    }
}
