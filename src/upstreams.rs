//! Named upstreams at run time (`upstreams:`, DESIGN §1): each one a Pingora
//! [`LoadBalancer`] over its addresses, round robin, skipping those its optional active
//! health check found dead. A name with one `url` is a pool of one.
//!
//! Each address keeps its own TLS/SNI host and timeouts ([`UpstreamTarget`]); Pingora pools
//! connections per peer, so every named upstream has its own connections. Pools are built
//! from each config put in force (names resolve then, never per request); a pool's health
//! check runs on a thread of its own until the pool is replaced.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Weak};

use pingora::http::RequestHeader;
use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;

use crate::config::{Config, HealthCheck, NamedUpstream, UpstreamTarget};

/// Every named upstream of a config, by name.
#[derive(Default)]
pub struct Pools(HashMap<String, Arc<Pool>>);

/// One named upstream: the balancer over its resolved addresses, and each address's target.
pub struct Pool {
    lb: LoadBalancer<RoundRobin>,
    targets: HashMap<SocketAddr, UpstreamTarget>,
}

impl Pools {
    /// Resolves every named upstream's addresses (blocking: at start and reload only) and
    /// starts the health checks.
    pub fn build(cfg: &Config) -> Pools {
        let pools = cfg
            .upstreams
            .values()
            .filter_map(|u| Some((u.name.clone(), Pool::build(u)?)))
            .collect();
        Pools(pools)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.0.get(name)
    }
}

impl Pool {
    fn build(u: &NamedUpstream) -> Option<Arc<Pool>> {
        let mut targets = HashMap::new();
        for t in &u.targets {
            match (t.host.as_str(), t.port).to_socket_addrs() {
                Ok(mut addrs) => {
                    if let Some(a) = addrs.next() {
                        targets.insert(a, t.clone());
                    }
                }
                Err(e) => {
                    tracing::error!(upstream = %u.name, host = %t.host, error = %e, "an upstream address does not resolve; it is left out of the pool");
                }
            }
        }
        let mut lb = match LoadBalancer::<RoundRobin>::try_from_iter(targets.keys().copied()) {
            Ok(lb) => lb,
            Err(e) => {
                tracing::error!(upstream = %u.name, error = %e, "cannot build the upstream pool");
                return None;
            }
        };
        if let (Some(hc), Some(first)) = (&u.health_check, u.targets.first()) {
            match health_check(hc, first) {
                Some(check) => lb.set_health_check(check),
                None => {
                    tracing::error!(upstream = %u.name, "cannot build the health check request")
                }
            }
        }
        let pool = Arc::new(Pool { lb, targets });
        if let Some(hc) = &u.health_check {
            spawn_health_checks(&u.name, Arc::downgrade(&pool), hc.interval);
        }
        Some(pool)
    }

    /// The next healthy address, round robin, with its target; `None` when none is.
    pub fn pick(&self) -> Option<(SocketAddr, &UpstreamTarget)> {
        let backend = self.lb.select(b"", 256)?;
        let addr = backend.addr.as_inet().copied()?;
        Some((addr, self.targets.get(&addr)?))
    }
}

/// `GET <path>` with the upstream's Host, any 200 being healthy; one failure marks an
/// address down and one success up again.
fn health_check(hc: &HealthCheck, t: &UpstreamTarget) -> Option<Box<HttpHealthCheck>> {
    let mut check = HttpHealthCheck::new(&t.authority, t.tls);
    if t.tls {
        check.peer_template.sni = t.host.clone();
    }
    let mut req = RequestHeader::build("GET", hc.path.as_bytes(), None).ok()?;
    req.append_header("Host", t.authority.as_str()).ok()?;
    check.req = req;
    check.peer_template.options.connection_timeout = Some(t.connect_timeout);
    Some(Box::new(check))
}

/// Runs the pool's health check every `interval` on a thread of its own (Pingora's own
/// runtimes serve requests), until the pool is dropped by a reload.
fn spawn_health_checks(name: &str, pool: Weak<Pool>, interval: std::time::Duration) {
    let spawned = crate::background::spawn(format!("tollgate-hc-{name}"), move || async move {
        loop {
            let Some(p) = pool.upgrade() else { return };
            p.lb.backends().run_health_check(true).await;
            drop(p);
            tokio::time::sleep(interval).await;
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(upstream = %name, error = %e, "cannot start the health check");
    }
}
