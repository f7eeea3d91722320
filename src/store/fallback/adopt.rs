//! Local admissions that hold slots, registered in the shared store once it answers again
//! (DESIGN §4): while an instance decides on its local share, the instances still on Redis
//! cannot see what it runs, so a capped route may run up to its cap plus the degraded
//! instances' shares. When the store is back, this instance registers every request it
//! admitted locally and still runs as a lease there — before it admits anything new, and
//! within a few hundred ms without traffic — so that the cap is exact again. `on_error: allow`
//! admits past the caps, but what it runs is registered the same way, so that what the store
//! admits next counts it. A request still waiting in a local queue when the store answers
//! leaves it for the store's decision (`local.rs`, `take_in_turn`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::{FallbackStore, SharedStore};
use crate::identity::KeyHash;
use crate::store::{lock, redis::RedisLease, AdmitRequest, StoreError};

/// How often local admissions still unregistered are offered to the store.
const ADOPT_EVERY: Duration = Duration::from_millis(200);

/// A running local admission's slots, and its lease in the shared store once registered.
#[derive(Debug)]
struct Entry {
    route: Option<Arc<str>>,
    /// The key's own lease set too (it has an in-flight cap).
    key_slot: bool,
    /// The request's key: the route counts the lease for it (its per-key share).
    key: KeyHash,
    registered: bool,
    /// Its lease there (released as it drops).
    shared: Option<RedisLease>,
}

/// The running local admissions that hold slots.
#[derive(Debug, Default)]
pub(crate) struct Adoptions {
    entries: Mutex<HashMap<u64, Entry>>,
    next: std::sync::atomic::AtomicU64,
    /// One registration round at a time (requests that arrive meanwhile wait for it).
    round: tokio::sync::Mutex<()>,
    retrying: std::sync::atomic::AtomicBool,
}

/// Held by a local admission's lease: its entry goes (and its shared lease is released) with it.
#[derive(Debug)]
pub(crate) struct Adoptable {
    of: Weak<Adoptions>,
    id: u64,
}

impl Drop for Adoptable {
    fn drop(&mut self) {
        if let Some(a) = self.of.upgrade() {
            // Its shared lease, if any, is released as it drops.
            let entry = lock(&a.entries).remove(&self.id);
            drop(entry);
        }
    }
}

impl Adoptions {
    fn register(self: &Arc<Self>, req: &AdmitRequest) -> Adoptable {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = Entry {
            route: req.route_cap.map(|_| req.route.clone()),
            key_slot: req.key_cap.is_some(),
            key: req.key,
            registered: false,
            shared: None,
        };
        lock(&self.entries).insert(id, entry);
        Adoptable {
            of: Arc::downgrade(self),
            id,
        }
    }

    fn pending(&self) -> Vec<(u64, Option<Arc<str>>, bool, KeyHash)> {
        lock(&self.entries)
            .iter()
            .filter(|(_, e)| !e.registered)
            .map(|(id, e)| (*id, e.route.clone(), e.key_slot, e.key))
            .collect()
    }

    pub(crate) fn any_pending(&self) -> bool {
        lock(&self.entries).values().any(|e| !e.registered)
    }
}

impl<S: SharedStore> FallbackStore<S> {
    /// Registers a local admission that holds slots (`on_error: local`), to be registered in
    /// the shared store when it answers again.
    pub(super) fn adoptable(self: &Arc<Self>, req: &AdmitRequest) -> Option<Adoptable> {
        if req.route_cap.is_none() && req.key_cap.is_none() {
            return None;
        }
        let guard = self.adoptions.register(req);
        if !self
            .adoptions
            .retrying
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            let store = Arc::downgrade(self);
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(adopt_in_background(store));
            } else {
                self.adoptions
                    .retrying
                    .store(false, std::sync::atomic::Ordering::Release);
            }
        }
        Some(guard)
    }

    /// Registers every running local admission not registered yet as a lease in the shared
    /// store; the first failure ends the round (the store is still away).
    pub(super) async fn adopt_local(&self) -> Result<(), StoreError> {
        if !self.adoptions.any_pending() {
            return Ok(());
        }
        let _round = self.adoptions.round.lock().await;
        for (id, route, key_slot, key) in self.adoptions.pending() {
            let slot = key_slot.then_some(&key);
            let lease = self.shared.adopt(route.as_deref(), slot, &key).await?;
            let mut entries = lock(&self.adoptions.entries);
            match entries.get_mut(&id) {
                Some(e) if !e.registered => {
                    e.registered = true;
                    e.shared = lease;
                }
                // It ended meanwhile: the lease goes again (released as it drops).
                _ => {
                    drop(entries);
                    drop(lease);
                }
            }
        }
        Ok(())
    }
}

/// Offers the unregistered local admissions to the store every [`ADOPT_EVERY`] until none is
/// left: the store may come back while no request arrives.
async fn adopt_in_background<S: SharedStore>(store: Weak<FallbackStore<S>>) {
    loop {
        tokio::time::sleep(ADOPT_EVERY).await;
        let Some(s) = store.upgrade() else { return };
        let _ = s.adopt_local().await;
        if !s.adoptions.any_pending() {
            s.adoptions
                .retrying
                .store(false, std::sync::atomic::Ordering::Release);
            // One registered meanwhile may have seen the flag still set.
            if !s.adoptions.any_pending()
                || s.adoptions
                    .retrying
                    .swap(true, std::sync::atomic::Ordering::AcqRel)
            {
                return;
            }
        }
    }
}
