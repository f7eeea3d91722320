//! In-flight slots as leases: ids in sorted sets scored by expiry, so that a crashed
//! instance's slots lapse by themselves after `lease_ttl`. A long request renews its leases
//! every `lease_ttl / 3`; a finished one releases them (explicitly, or from its drop guard).
//!
//! A release that cannot reach Redis is remembered and sent again every 200 ms until it does
//! (or until the lease would have lapsed anyway), so that slots of requests that finished
//! during an outage are free as soon as Redis is back, with no further traffic needed. Every
//! lease held is registered, so that an exiting instance can release them all first.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::Guard;
use super::script::{self, Lease, Op};
use super::{slices, RedisBackend};
use crate::store::lock;
use crate::store::StoreError;

/// How often releases that failed are sent again.
const RETRY_EVERY: Duration = Duration::from_millis(200);
/// Bound on remembered releases (an outage under heavy load); past it, leases lapse by TTL.
const MAX_UNRELEASED: usize = 100_000;

/// A release that has not reached Redis yet.
#[derive(Debug)]
pub(super) struct Unreleased {
    keys: Vec<String>,
    id: String,
    /// When the lease lapses by itself: no point in releasing it after that.
    lapses: Instant,
}

/// A lease's sets, and the key a capped route's fair queue counts it for.
#[derive(Debug, Clone)]
pub(super) struct Sets {
    pub(super) sets: Vec<String>,
    /// The key's tag (`keys::key_tag`) when one of `sets` is a capped route's: a renewal that
    /// finds the lease gone there (Redis lost its data, or it lapsed while this instance was
    /// paused) makes it again as that key's (`lua/queue.lua`, `hold`), so that the key's
    /// share of the route (`max_in_flight_per_key`) and `/admin/routes` count it.
    pub(super) key: Option<String>,
}

impl Sets {
    pub(super) fn new(sets: Vec<String>, key: Option<String>) -> Self {
        Sets { sets, key }
    }
}

/// Leases this instance holds (id → lease sets) and releases still to be sent.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) live: HashMap<String, Sets>,
    unreleased: Vec<Unreleased>,
    retrying: bool,
}

/// Leases a request holds in Redis; released explicitly or, failing that, on drop.
#[derive(Debug)]
pub struct RedisLease {
    store: Arc<RedisBackend>,
    keys: Vec<String>,
    id: String,
    renew: Option<tokio::task::AbortHandle>,
    released: bool,
}

impl RedisLease {
    /// Holds `id` in the lease sets `keys` and keeps it alive until released; `key` is the
    /// tag of the key a capped route's set among them counts it for ([`Sets::key`]).
    pub(super) fn hold(
        store: &Arc<RedisBackend>,
        keys: Vec<String>,
        key: Option<String>,
        id: String,
    ) -> Self {
        let sets = Sets::new(keys.clone(), key);
        let renew = store.spawn_renewal(sets.clone(), id.clone());
        lock(&store.held).live.insert(id.clone(), sets);
        store.watch_for_data_loss();
        RedisLease {
            store: store.clone(),
            keys,
            id,
            renew: Some(renew),
            released: false,
        }
    }

    pub async fn release(mut self) {
        if let Some(r) = self.renew.take() {
            r.abort();
        }
        self.store
            .release_keys(self.keys.clone(), self.id.clone())
            .await;
        // Only now: a release cut short is finished by the drop guard (it is idempotent).
        self.released = true;
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
            h.spawn(async move {
                store.release_keys(keys, id).await;
            });
        }
    }
}

impl RedisBackend {
    /// Keeps a long request's leases alive: renewed every `lease_ttl / 3` until released, and
    /// never once its release was sent (the exit releases every live lease at once, the
    /// requests that hold them still running: a renewal after that would make one again).
    fn spawn_renewal(self: &Arc<Self>, sets: Sets, id: String) -> tokio::task::AbortHandle {
        let store = self.clone();
        let every = self.lease_ttl / 3;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if !lock(&store.held).live.contains_key(&id) {
                    return;
                }
                let _ = store.renew(&sets, &id, Guard::Breaker).await;
            }
        })
        .abort_handle()
    }

    /// Registers (as live: re-registered after Redis lost its data, released at exit) and
    /// renews the key's lease a capped request took with its charge, while it is held for its
    /// turn and while it waits for its slot; `RedisLease::hold` takes over once it is served.
    pub(super) fn keep_key_lease(
        self: &Arc<Self>,
        key_slots: &[String],
        id: &str,
    ) -> Option<tokio::task::AbortHandle> {
        if key_slots.is_empty() {
            return None;
        }
        let sets = Sets::new(key_slots.to_vec(), None);
        lock(&self.held).live.insert(id.to_string(), sets.clone());
        self.watch_for_data_loss();
        Some(self.spawn_renewal(sets, id.to_string()))
    }

    /// Renews lease `id` in all of `held`'s sets for `lease_ttl`, making it again where it
    /// is missing: in a capped route's set through its queue (`hold`), as its key's, the
    /// other sets as plain leases. The first call that fails ends it (renewing is
    /// idempotent: sending it all again is safe).
    pub(super) async fn renew(
        &self,
        held: &Sets,
        id: &str,
        guard: Guard,
    ) -> Result<(), StoreError> {
        let ttl_us = self.lease_ttl.as_micros() as u64;
        let mut calls = Vec::with_capacity(held.sets.len());
        let mut others = Vec::new();
        for k in &held.sets {
            match (super::keys::queue_keys(k), &held.key) {
                (Some(q), Some(key)) => calls.push(self.queue_script.hold(&q, id, key, ttl_us)),
                _ => others.push(k.clone()),
            }
        }
        for sets in self.lease_groups(&others) {
            calls.push(Lease { sets, id, ttl_us }.invocation());
        }
        for call in calls {
            self.call_repeatable_guarded::<redis::Value>(guard, call)
                .await?;
        }
        Ok(())
    }

    /// The lease stays registered as live until the release is sent or remembered: a release
    /// cut short (its runtime shutting down at exit) is still found by `release_everything`.
    pub(super) async fn release_keys(self: &Arc<Self>, keys: Vec<String>, id: String) {
        if keys.is_empty() {
            return;
        }
        // A release on a capped route may drop a dead instance's waiters: this instance beats
        // there a while (and on while the route owes their charges), so that their charges are
        // handed out and given back even if nobody else calls on the route.
        for k in &keys {
            if let Some(q) = super::keys::queue_keys(k) {
                self.beat_on(&q);
            }
        }
        if self.lease_op(&keys, &id, 0).await.is_ok() {
            lock(&self.held).live.remove(&id);
        } else {
            // Releasing is idempotent: sending it again is always safe.
            self.remember_release(keys, id);
        }
    }

    fn remember_release(self: &Arc<Self>, keys: Vec<String>, id: String) {
        let start = {
            let mut held = lock(&self.held);
            held.live.remove(&id);
            if held.unreleased.len() < MAX_UNRELEASED {
                held.unreleased.push(Unreleased {
                    keys,
                    id,
                    lapses: Instant::now() + self.lease_ttl,
                });
            }
            !std::mem::replace(&mut held.retrying, true)
        };
        if start {
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn(self.clone().retry_releases());
                }
                Err(_) => lock(&self.held).retrying = false,
            }
        }
    }

    /// Sends the remembered releases until none is left; stops at the first failure of a round
    /// (the store is still unreachable) and tries again a little later.
    async fn retry_releases(self: Arc<Self>) {
        loop {
            tokio::time::sleep(RETRY_EVERY).await;
            let now = Instant::now();
            let batch = std::mem::take(&mut lock(&self.held).unreleased);
            let mut rest = batch.into_iter().filter(|u| u.lapses > now);
            let mut failed = vec![];
            while let Some(u) = rest.next() {
                let sent = self.lease_op(&u.keys, &u.id, 0).await;
                if sent.is_err() {
                    failed.push(u);
                    failed.extend(rest);
                    break;
                }
            }
            let mut held = lock(&self.held);
            held.unreleased.extend(failed);
            if held.unreleased.is_empty() {
                held.retrying = false;
                return;
            }
        }
    }

    /// Releases every lease this instance holds or still owes Redis, bypassing the breaker
    /// (this is the last chance). The caller bounds the time it may take: the one call
    /// outside `guard`, all on one connection, sent at once.
    pub(super) async fn release_everything(self: &Arc<Self>) {
        let mut sends = tokio::task::JoinSet::new();
        self.give_back_owed(&mut sends);
        let slices = self.slices.hand_back_all();
        let all: Vec<(Vec<String>, String)> = {
            let mut held = lock(&self.held);
            let live = std::mem::take(&mut held.live);
            let owed = std::mem::take(&mut held.unreleased);
            live.into_iter()
                .map(|(id, held)| (held.sets, id))
                .chain(owed.into_iter().map(|u| (u.keys, u.id)))
                .collect()
        };
        if all.is_empty() && slices.is_empty() {
            while sends.join_next().await.is_some() {}
            return;
        }
        let Ok(conn) = self.conns.get().await else {
            while sends.join_next().await.is_some() {}
            return;
        };
        // Budget slices are settled: what was not spent goes back to the fleet, like the
        // slots, and what was starts draining.
        for s in slices {
            let mut conn = conn.clone();
            sends.spawn(async move {
                let id = slices::hold_field(s.id);
                let settle = s.op(&id, Instant::now()).invocation();
                let _ = script::invoke::<i64>(&settle, &mut conn).await;
            });
        }
        for (keys, id) in all {
            let (store, mut conn) = (self.clone(), conn.clone());
            sends.spawn(async move {
                for release in store.release_calls(&keys, &id) {
                    let _ = script::invoke::<redis::Value>(&release, &mut conn).await;
                }
            });
        }
        while sends.join_next().await.is_some() {}
        tracing::info!("released this instance's in-flight leases and budget slices");
    }

    /// A lease's sets as script calls: one call on one node; on Redis Cluster one call per
    /// set, since a key's lease set and a route's are in different hash slots. No call for
    /// no sets (a lease only in capped routes' queues is renewed there).
    pub(super) fn lease_groups<'a>(&self, keys: &'a [String]) -> Vec<&'a [String]> {
        if keys.is_empty() {
            vec![]
        } else if self.conns.is_cluster() {
            keys.chunks(1).collect()
        } else {
            vec![keys]
        }
    }

    /// Renews (`ttl_us` > 0) or releases (0) lease `id` in all of `keys`; the first call that
    /// fails ends it (a lease op is idempotent: sending it all again is safe).
    /// A route's lease set is released through its queue, which hands the slot on.
    pub(super) async fn lease_op(
        &self,
        keys: &[String],
        id: &str,
        ttl_us: u64,
    ) -> Result<(), StoreError> {
        if ttl_us == 0 {
            for release in self.release_calls(keys, id) {
                self.call_repeatable::<redis::Value>(release).await?;
            }
            return Ok(());
        }
        for sets in self.lease_groups(keys) {
            self.op_repeatable(&Lease { sets, id, ttl_us }).await?;
        }
        Ok(())
    }

    /// The calls that release lease `id` from its sets `keys`: a capped route's set through
    /// its fair queue (`release`: its key's count on the route goes down and the slot goes to
    /// the next waiter), the others as plain leases. Every release goes this way, a request's
    /// and an exiting instance's alike.
    fn release_calls<'a>(&'a self, keys: &[String], id: &str) -> Vec<script::Call<'a>> {
        let mut calls = Vec::with_capacity(keys.len());
        let mut others = Vec::new();
        for k in keys {
            match super::keys::queue_keys(k) {
                Some(q) => calls.push(self.queue_script.release(&q, id)),
                None => others.push(k.clone()),
            }
        }
        for sets in self.lease_groups(&others) {
            calls.push(
                Lease {
                    sets,
                    id,
                    ttl_us: 0,
                }
                .invocation(),
            );
        }
        calls
    }
}
