//! Who is paying: the API key of a request, hashed before it is used anywhere.
//!
//! The raw key is read from the configured sources, hashed with SHA-256 and dropped. Everything
//! downstream — the budget's store key, logs, metrics — sees only the hash, a registry id, or a
//! short hash prefix.

use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::{Anonymous, Config, IdentitySource};
use crate::policy::Policy;

/// SHA-256 of an API key (or, for anonymous callers, see [`client_ip_hash`]).
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
    /// Two credentials in one request that disagree.
    Conflicting,
}

/// Reads the key from the sources, in order. Every value every source carries must agree: a
/// key header repeated with another value, or a key header and a Bearer token that differ, is
/// refused rather than resolved by "first wins" (the upstream would see both).
pub fn extract_key<'a>(
    sources: &[IdentitySource],
    headers: &'a HeaderMap,
) -> Result<Option<&'a [u8]>, Unauthenticated> {
    let mut found: Option<&'a [u8]> = None;
    for s in sources {
        let (name, bearer) = match s {
            IdentitySource::Header(name) => (name.as_str(), false),
            IdentitySource::Bearer => ("authorization", true),
        };
        for v in headers.get_all(name) {
            let v = v.as_bytes().trim_ascii();
            let v = if bearer {
                match (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
                    .then(|| v[7..].trim_ascii())
                {
                    Some(k) => k,
                    None => continue,
                }
            } else {
                v
            };
            if v.is_empty() {
                continue;
            }
            match found {
                None => found = Some(v),
                Some(f) if f == v => {}
                Some(_) => return Err(Unauthenticated::Conflicting),
            }
        }
    }
    Ok(found)
}

/// The budget key of an anonymous caller. It hashes a NUL byte, which no header value can
/// carry, so no API key's hash can ever name a client address's budget.
pub fn client_ip_hash(ip: IpAddr) -> KeyHash {
    hash_key(format!("\0ip:{ip}").as_bytes())
}

/// Identifies a request from its key (if any) and client address.
pub fn identify(
    config: &Config,
    key: Result<Option<&[u8]>, Unauthenticated>,
    client: Option<IpAddr>,
) -> Result<Identity, Unauthenticated> {
    match key? {
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
                hash: client_ip_hash(ip),
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

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn sources_in_order() {
        let sources = vec![
            IdentitySource::Header("x-api-key".into()),
            IdentitySource::Bearer,
        ];
        let key = |pairs: &[(&'static str, &'static str)]| {
            extract_key(&sources, &headers(pairs)).map(|k| k.map(<[u8]>::to_vec))
        };
        assert_eq!(
            key(&[("authorization", "Bearer k2")]),
            Ok(Some(b"k2".to_vec()))
        );
        assert_eq!(
            key(&[("authorization", "bearer  k2 ")]),
            Ok(Some(b"k2".to_vec()))
        );
        assert_eq!(
            key(&[("x-api-key", " "), ("authorization", "Basic abc")]),
            Ok(None)
        );
        assert_eq!(key(&[]), Ok(None));
        // Agreeing copies are one key; disagreeing ones are refused, whatever the order.
        assert_eq!(
            key(&[("x-api-key", "k1"), ("authorization", "Bearer k1")]),
            Ok(Some(b"k1".to_vec()))
        );
        assert_eq!(
            key(&[("x-api-key", "k1"), ("authorization", "Bearer k2")]),
            Err(Unauthenticated::Conflicting)
        );
        assert_eq!(
            key(&[("x-api-key", "k1"), ("x-api-key", "k2")]),
            Err(Unauthenticated::Conflicting)
        );
        assert_eq!(
            key(&[("x-api-key", "k1"), ("x-api-key", "k1")]),
            Ok(Some(b"k1".to_vec()))
        );
    }

    #[test]
    fn registry_and_anonymous() {
        let open = cfg("");
        let id = identify(&open, Ok(Some(b"abc")), None).unwrap();
        assert_eq!(id.policy.name, "default");
        assert_eq!(id.log_name(), "key:ba7816bf");
        assert_eq!(
            identify(&open, Ok(None), None).unwrap_err(),
            Unauthenticated::Missing
        );

        let reg = cfg(&format!(
            "keys:\n  - {{id: acme, sha256: \"{}\"}}\nidentity: {{anonymous: client_ip}}\n",
            hex::encode(hash_key(b"secret"))
        ));
        assert_eq!(
            identify(&reg, Ok(Some(b"secret")), None)
                .unwrap()
                .log_name(),
            "acme"
        );
        assert_eq!(
            identify(&reg, Ok(Some(b"other")), None).unwrap_err(),
            Unauthenticated::Unknown
        );
        let ip = identify(&reg, Ok(None), Some("10.1.2.3".parse().unwrap())).unwrap();
        assert_eq!(ip.hash, client_ip_hash("10.1.2.3".parse().unwrap()));
        assert_ne!(ip.hash, hash_key(b"ip:10.1.2.3"));
    }
}
