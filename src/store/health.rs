//! The store's state as the status page shows it: which backend, whether it can decide, the
//! breaker, and whether the `on_error` policy decides now.

use super::Store;

/// What the status page says about the store.
#[derive(Debug, Clone, Copy)]
pub struct Health {
    pub backend: &'static str,
    /// Requests can be decided (by the store or its fallback policy).
    pub ready: bool,
    /// Decisions follow `store.on_error` now.
    pub degraded: bool,
    /// The shared store's circuit breaker (`None` on the memory store).
    pub breaker_open: Option<bool>,
    pub on_error: Option<crate::config::OnError>,
    pub fleet_size: u32,
}

impl Store {
    /// The store's state for the status page (`/admin/status`).
    pub fn health(&self) -> Health {
        match self {
            Store::Memory(_) => Health {
                backend: "memory",
                ready: true,
                degraded: false,
                breaker_open: None,
                on_error: None,
                fleet_size: 1,
            },
            Store::Redis(r) => {
                let (on_error, fleet_size) = r.policy();
                Health {
                    backend: "redis",
                    ready: r.ready(),
                    degraded: r.degraded(),
                    breaker_open: Some(!r.shared().breaker_closed()),
                    on_error: Some(on_error),
                    fleet_size,
                }
            }
        }
    }
}
