//! Who is paying: the API key of a request, hashed before it is used anywhere.
//!
//! The raw key is read from the configured sources, hashed with SHA-256 and dropped. Everything
//! downstream — the budget's store key, logs, metrics — sees only the hash, a registry id, or a
//! short hash prefix.

use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;
use sha2::{Digest, Sha256};

pub use crate::config::origin::{Origin, TrustedProxies};
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
    /// What logs may show: the registry id, or `key:` and 8 hex digits of the hash. Once per
    /// logged request, so it allocates nothing.
    pub fn log_name(&self) -> LogName<'_> {
        match &self.id {
            Some(id) => LogName::Id(id),
            None => {
                let mut name = *b"key:00000000";
                // 4 bytes are exactly 8 hex digits: cannot fail.
                let _ = hex::encode_to_slice(&self.hash[..4], &mut name[4..]);
                LogName::Hash(name)
            }
        }
    }
}

/// [`Identity::log_name`]: read it as a `&str`.
#[derive(Debug, Clone, Copy)]
pub enum LogName<'a> {
    Id(&'a str),
    Hash([u8; 12]),
}

impl std::ops::Deref for LogName<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            LogName::Id(id) => id,
            // ASCII by construction.
            LogName::Hash(b) => std::str::from_utf8(b).unwrap_or("key:"),
        }
    }
}

impl std::fmt::Display for LogName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self)
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
            IdentitySource::Header(name) => (name, false),
            IdentitySource::Bearer => (&http::header::AUTHORIZATION, true),
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
            IdentitySource::Header(http::HeaderName::from_static("x-api-key")),
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
        assert_eq!(&*id.log_name(), "key:ba7816bf");
        assert_eq!(
            identify(&open, Ok(None), None).unwrap_err(),
            Unauthenticated::Missing
        );

        let reg = cfg(&format!(
            "keys:\n  - {{id: acme, sha256: \"{}\"}}\nidentity: {{anonymous: client_ip}}\n",
            hex::encode(hash_key(b"secret"))
        ));
        assert_eq!(
            &*identify(&reg, Ok(Some(b"secret")), None)
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

    fn proxies(nets: &[&str]) -> TrustedProxies {
        TrustedProxies::new(nets.iter().map(|n| n.parse().unwrap()).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ip_text_is_display() {
        for s in [
            "0.0.0.0",
            "1.2.3.4",
            "10.0.255.9",
            "255.255.255.255",
            "::1",
            "fd00::1",
        ] {
            assert_eq!(crate::config::origin::ip_text(ip(s)), ip(s).to_string());
        }
    }

    #[test]
    fn forwarded_for_is_believed_from_trusted_peers_only() {
        let t = proxies(&["10.0.0.0/8", "fd00::/8"]);
        let xff = headers(&[("x-forwarded-for", "6.6.6.6, 1.2.3.4")]);
        // An outsider's header is ignored, and replaced upstream by its own address.
        let o = t.origin(ip("203.0.113.9"), &xff);
        assert_eq!((o.client, o.trusted_peer), (ip("203.0.113.9"), false));
        assert_eq!(o.forwarded_for(&xff), "203.0.113.9");
        // A trusted balancer: the right-most untrusted address; the upstream gets the chain
        // with the balancer appended.
        let o = t.origin(ip("10.1.1.1"), &xff);
        assert_eq!((o.client, o.trusted_peer), (ip("1.2.3.4"), true));
        assert_eq!(o.forwarded_for(&xff), "6.6.6.6, 1.2.3.4, 10.1.1.1");
        // Trusted hops are skipped, across header lines, and the IPv4-mapped form is the same.
        let two = headers(&[
            ("x-forwarded-for", "6.6.6.6, 1.2.3.4:5555"),
            ("x-forwarded-for", "10.2.2.2"),
        ]);
        let o = t.origin(ip("::ffff:10.1.1.1"), &two);
        assert_eq!(o.client, ip("1.2.3.4"));
        assert_eq!(o.peer, ip("10.1.1.1"));
        // Only trusted hops: the left-most of them. Garbage stops the walk at the last good hop.
        let o = t.origin(ip("10.1.1.1"), &headers(&[("x-forwarded-for", "10.3.3.3")]));
        assert_eq!(o.client, ip("10.3.3.3"));
        let o = t.origin(
            ip("10.1.1.1"),
            &headers(&[("x-forwarded-for", "1.2.3.4, junk, 10.3.3.3")]),
        );
        assert_eq!(o.client, ip("10.3.3.3"));
        // No header: the peer itself.
        let o = t.origin(ip("fd00::1"), &HeaderMap::new());
        assert_eq!((o.client, o.trusted_peer), (ip("fd00::1"), true));
        assert_eq!(o.forwarded_for(&HeaderMap::new()), "fd00::1");
        // Nothing trusted (the default): never believed.
        let o = TrustedProxies::default().origin(ip("10.1.1.1"), &xff);
        assert_eq!(o.client, ip("10.1.1.1"));
    }

    #[test]
    fn trusted_proxies_errors_name_the_entry() {
        let y = |list: &str| {
            format!(
                "upstream: {{url: \"http://127.0.0.1:1\"}}\nrate_limits:\n  default: {{window: 60s, max_cost: 120}}\nidentity: {{trusted_proxies: {list}}}\n"
            )
        };
        let ok = Config::parse(
            &y("[\"10.0.0.0/8\", \"192.0.2.7\", \"fd00::/8\"]"),
            &EnvOverrides::default(),
        )
        .unwrap();
        assert!(ok.trusted_proxies.contains("192.0.2.7".parse().unwrap()));
        assert!(!ok.trusted_proxies.contains("192.0.2.8".parse().unwrap()));
        let errs = Config::parse(
            &y("[\"10.0.0.0/8\", \"10.0.0.1/8\", \"lb\"]"),
            &EnvOverrides::default(),
        )
        .unwrap_err();
        let errs: Vec<String> = errs.0.iter().map(|e| e.to_string()).collect();
        assert_eq!(
            errs,
            vec![
                "identity.trusted_proxies[1]: \"10.0.0.1/8\" has host bits set; the network is \"10.0.0.0/8\"".to_string(),
                "identity.trusted_proxies[2]: expected a CIDR such as \"10.0.0.0/8\" or an IP address, got \"lb\"".to_string(),
            ]
        );
    }
}
