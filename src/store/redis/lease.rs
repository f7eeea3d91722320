//! In-flight slots as leases: ids in sorted sets scored by expiry, so that a crashed
//! instance's slots lapse by themselves after `lease_ttl`. A long request renews its leases
//! every `lease_ttl / 3`; a finished one releases them (explicitly, or from its drop guard).

use std::sync::Arc;

use tokio::sync::Notify;

use super::RedisBackend;
use crate::store::lock;

/// Leases a request holds in Redis; released explicitly or, failing that, on drop.
#[derive(Debug)]
pub struct RedisLease {
    store: Arc<RedisBackend>,
    keys: Vec<String>,
    id: String,
    route: Arc<str>,
    renew: Option<tokio::task::AbortHandle>,
    released: bool,
}

impl RedisLease {
    /// Holds `id` in the lease sets `keys` and keeps it alive until released.
    pub(super) fn hold(
        store: &Arc<RedisBackend>,
        keys: Vec<String>,
        id: String,
        route: Arc<str>,
    ) -> Self {
        let renew = store.spawn_renewal(keys.clone(), id.clone());
        RedisLease {
            store: store.clone(),
            keys,
            id,
            route,
            renew: Some(renew),
            released: false,
        }
    }

    pub async fn release(mut self) {
        self.released = true;
        if let Some(r) = self.renew.take() {
            r.abort();
        }
        self.store.release_keys(&self.keys, &self.id).await;
        self.store.wake(&self.route);
    }
}

impl Drop for RedisLease {
    fn drop(&mut self) {
        if let Some(r) = self.renew.take() {
            r.abort();
        }
        if self.released {
            return;
        }
        // Dropped without release (a cancelled or panicking request): release in the background.
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            let keys = std::mem::take(&mut self.keys);
            let id = std::mem::take(&mut self.id);
            let route = self.route.clone();
            h.spawn(async move {
                store.release_keys(&keys, &id).await;
                store.wake(&route);
            });
        }
    }
}

impl RedisBackend {
    /// Keeps a long request's leases alive: renewed every `lease_ttl / 3` until released.
    fn spawn_renewal(self: &Arc<Self>, keys: Vec<String>, id: String) -> tokio::task::AbortHandle {
        let store = self.clone();
        let every = self.lease_ttl / 3;
        let ttl_us = self.lease_ttl.as_micros() as u64;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let _ = store
                    .call::<i64>(store.script.lease(&keys, &id, ttl_us))
                    .await;
            }
        })
        .abort_handle()
    }

    async fn release_keys(&self, keys: &[String], id: &str) {
        if keys.is_empty() {
            return;
        }
        // A failed release is not retried: the lease lapses after lease_ttl.
        let _ = self.call::<i64>(self.script.lease(keys, id, 0)).await;
    }

    pub(super) fn notify_for(&self, route: &Arc<str>) -> Arc<Notify> {
        lock(&self.wake)
            .entry(route.clone())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }

    fn wake(&self, route: &Arc<str>) {
        if let Some(n) = lock(&self.wake).get(route) {
            n.notify_waiters();
        }
    }
}
