//! What a running gateway shares between its requests, the admin listener and the signal
//! handlers: the config in force (swapped whole on reload, with its metric handles), the
//! store (which outlives reloads, so budgets do too), the upstream's address and the drain.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::Config;
use crate::shutdown::Drain;
use crate::store::Store;
use crate::telemetry::RouteMetricsTable;

/// A config as the gateway runs it, and everything built from it — its routes' metric
/// series, its named upstreams' pools, the upstream's resolved address — swapped as one on
/// reload: a request that holds a `Running` never pairs the new pools with the old routes.
#[derive(Debug)]
pub struct Running {
    pub config: Config,
    pub metrics: RouteMetricsTable,
    /// The named upstreams of this config (`upstreams:`).
    pub pools: crate::upstreams::Pools,
    /// The upstream's resolved address (`None`: its name did not resolve; 502 until a reload
    /// resolves it).
    pub upstream_addr: Option<SocketAddr>,
}

pub struct Shared {
    running: ArcSwap<Running>,
    pub store: Store,
    pub drain: Arc<Drain>,
    /// Requests this instance holds for `max_delay` (their memory is bounded): the proxy's,
    /// and a store's before a capped route's queue.
    pub holds: crate::hold::Holds,
    /// The tracer, when `tracing:` was on at start (a reload changes its sample ratio only).
    pub tracing: Option<crate::trace::Tracing>,
    /// The routes this instance queued fleet jobs on, for its collector to follow.
    pub queued_jobs: crate::jobs::fleet::Queued,
}

impl Shared {
    pub fn new(
        config: Config,
        store: Store,
        tracing: Option<crate::trace::Tracing>,
    ) -> Arc<Shared> {
        let addr = resolve(&config.upstream.host, config.upstream.port);
        let metrics = RouteMetricsTable::new(&config.router, None);
        crate::telemetry::config_loaded(&config.hash);
        let pools = crate::upstreams::Pools::build(&config, &crate::upstreams::Pools::default());
        let drain = Drain::new();
        let holds = crate::hold::Holds::new(crate::hold::MAX_HELD, drain.clone());
        store.set_holds(&holds);
        Arc::new(Shared {
            running: ArcSwap::from_pointee(Running {
                config,
                metrics,
                pools,
                upstream_addr: addr,
            }),
            store,
            drain,
            holds,
            tracing,
            queued_jobs: Default::default(),
        })
    }

    /// The config in force now; a request keeps the one it started with.
    pub fn running(&self) -> Arc<Running> {
        self.running.load_full()
    }

    /// Puts a validated config in force for new requests. Settings that only take effect on
    /// restart keep their running values, said so in the log; series of routes that are gone
    /// are removed.
    pub fn install(&self, mut new: Config) {
        let old = self.running.load_full();
        let was = &old.config;
        for field in new.keep_start_settings(was) {
            tracing::warn!("{field} takes effect on restart only; keeping the running value");
        }
        if was.tls.is_some() && was.client_limits.idle_timeout != new.client_limits.idle_timeout {
            tracing::warn!(
                "server.idle_timeout takes effect on restart only for HTTP/2 connections; \
                 HTTP/1.1 connections opened from now on take the new value"
            );
        }
        if was.tracing != new.tracing {
            crate::trace::Tracing::reload(self.tracing.as_ref(), new.tracing.as_ref());
        }
        let upstream_addr =
            if was.upstream.host != new.upstream.host || was.upstream.port != new.upstream.port {
                resolve(&new.upstream.host, new.upstream.port)
            } else {
                old.upstream_addr
            };
        // Built while the old pools are in force, so that their checkers carry over.
        let pools = crate::upstreams::Pools::build(&new, &old.pools);
        let metrics = RouteMetricsTable::new(&new.router, Some(&old.metrics));
        old.metrics.retire(&new.router);
        crate::telemetry::config_loaded(&new.hash);
        let running = Arc::new(Running {
            config: new,
            metrics,
            pools,
            upstream_addr,
        });
        self.running.store(running.clone());
        // After the swap: a request that still spends a slice now asks again under the new
        // budgets, and waiters see the new caps.
        self.store.reloaded(&crate::route::Reloaded::new(
            &old.config.router,
            &running.config.router,
        ));
        // The series of routes gone with the old config, unless requests still run on them
        // (then at a later scrape, once they have ended).
        drop(old);
        crate::telemetry::retire_routes();
    }
}

/// Resolves the upstream host (blocking; called at start and reload, never per request).
/// Prefers an IPv4 address when the name has both.
pub fn resolve(host: &str, port: u16) -> Option<SocketAddr> {
    match (host, port).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            addrs
                .iter()
                .find(|a| a.is_ipv4())
                .or(addrs.first())
                .copied()
        }
        Err(e) => {
            tracing::error!(host, error = %e, "upstream host does not resolve; answering 502 until it does");
            None
        }
    }
}
