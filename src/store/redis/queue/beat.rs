//! The instance's side of its routes' queues: who waits here, the grants Redis publishes to
//! this instance, and the beat that keeps its waiters alive in each queue and tells the queue
//! every id it has there (so that the queue drops what a failover made it remember wrongly).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::oneshot;

use super::super::conn::subscribed;
use super::super::keys::QueueKeys;
use super::{ALIVE_FOR, GRANT_TTL};
use crate::store::redis::RedisBackend;
use crate::store::{lock, StoreError};

/// How often an instance with waiters on a route beats there.
const BEAT_EVERY: Duration = Duration::from_millis(500);
/// Beats on a route after this instance's last waiter there left.
const IDLE_BEATS: u32 = 10;

/// What wakes a waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    /// Its slot: confirm it.
    Granted,
    /// The queue lost it (a failover, a flush) or cannot be reached: enter again.
    Requeue,
}

/// A route this instance beats on.
#[derive(Debug)]
pub(super) struct Beating {
    keys: QueueKeys,
    /// This instance's waiters there.
    pub(super) waiting: usize,
    /// Beats that failed in a row.
    failed: u32,
    /// Beats since the last waiter here left.
    idle: u32,
}

/// This instance's waiters, by waiter id, and the routes it beats on.
#[derive(Debug, Default)]
pub(in crate::store::redis) struct Waiters {
    pub(super) waiting: HashMap<String, (String, oneshot::Sender<Wake>)>,
    /// Every id this instance may have in a route's queue and has not given up (entering,
    /// waiting, confirming; then it is a lease held, in `Held::live`) → its route lease set.
    /// A beat names them, and the queue drops this instance's others (`lua/queue.lua`).
    pub(super) pending: HashMap<String, String>,
    /// Route lease set → what this instance beats there.
    pub(super) routes: HashMap<String, Beating>,
    /// The charges of this instance's requests that wait in a queue, by waiter id: whoever
    /// takes one out gives it back (the request as it leaves unserved, or the instance as it
    /// exits with the request still waiting).
    pub(in crate::store::redis) owed: HashMap<String, super::Owed>,
    running: bool,
}

impl Waiters {
    pub(super) fn deliver(&mut self, id: &str, wake: Wake) {
        if let Some((_, tx)) = self.waiting.remove(id) {
            let _ = tx.send(wake);
        }
    }

    /// The ids this instance has on the route of lease set `route`, short of its leases.
    fn on_route(&self, route: &str) -> Vec<String> {
        self.pending
            .iter()
            .filter(|(_, r)| *r == route)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

impl RedisBackend {
    /// Registers a waiter, and makes sure this instance beats on its route and listens for
    /// its grants.
    pub(super) fn wait_for(
        self: &Arc<Self>,
        keys: &QueueKeys,
        id: &str,
    ) -> oneshot::Receiver<Wake> {
        let (tx, rx) = oneshot::channel();
        self.beat_on(keys);
        let mut w = lock(&self.waiters);
        w.waiting.insert(id.to_string(), (keys[0].clone(), tx));
        if let Some(b) = w.routes.get_mut(&keys[0]) {
            b.waiting += 1;
        }
        rx
    }

    /// Makes sure this instance beats on the route of `keys` (for a while after its last
    /// waiter there leaves, or its last slot there is taken: a beat also clears what a
    /// failover made the queue remember wrongly) and listens for its grants.
    pub(in crate::store::redis) fn beat_on(self: &Arc<Self>, keys: &QueueKeys) {
        let start = {
            let mut w = lock(&self.waiters);
            let b = w.routes.entry(keys[0].clone()).or_insert_with(|| Beating {
                keys: keys.clone(),
                waiting: 0,
                failed: 0,
                idle: 0,
            });
            b.idle = 0;
            !std::mem::replace(&mut w.running, true)
        };
        if start {
            let weak = Arc::downgrade(self);
            let channel = format!("tollgate:q:{}", self.instance);
            let spawned = crate::background::spawn("tollgate-queue".into(), move || async move {
                tokio::join!(listen(weak.clone(), channel), beat(weak));
            });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start the queue's listener; waiters rely on their beats");
            }
        }
    }

    /// Every id this instance has on the route of lease set `route` (pending, then held as a
    /// lease: an id moves from one to the other registered in both for a moment, so it is
    /// never missed), and the id counter from before: the queue may drop this instance's
    /// other ids below it.
    fn ids_on_route(&self, route: &str) -> (u64, Vec<String>) {
        let (below, mut ids) = {
            let w = lock(&self.waiters);
            (
                self.lease_seq.load(std::sync::atomic::Ordering::Relaxed),
                w.on_route(route),
            )
        };
        let held = lock(&self.held);
        ids.extend(
            held.live
                .iter()
                .filter(|(_, held)| held.sets.iter().any(|k| k == route))
                .map(|(id, _)| id.clone()),
        );
        (below, ids)
    }
}

/// Delivers this instance's grants as Redis publishes them.
async fn listen(store: Weak<RedisBackend>, channel: String) {
    subscribed(store, channel, |s, id| {
        lock(&s.waiters).deliver(id, Wake::Granted)
    })
    .await;
}

/// Beats on every route this instance has waiters on; delivers grants the reply names, and
/// sends waiters the queue lost (or that it cannot reach for two beats) to enter again.
async fn beat(store: Weak<RedisBackend>) {
    loop {
        tokio::time::sleep(BEAT_EVERY).await;
        let Some(s) = store.upgrade() else { return };
        let routes: Vec<QueueKeys> = {
            let mut w = lock(&s.waiters);
            // A route is beaten on for a while after its last waiter here (the count goes
            // negative, one a beat): slots granted to waiters that never confirmed them lapse
            // and are handed on by the next call on the route.
            w.routes.retain(|_, b| {
                if b.waiting == 0 {
                    b.idle += 1;
                }
                b.waiting > 0 || b.idle < IDLE_BEATS
            });
            w.routes.values().map(|b| b.keys.clone()).collect()
        };
        for keys in routes {
            let (below, ids) = s.ids_on_route(&keys[0]);
            let mut inv = s.queue_script.call(&keys, "beat");
            inv.arg(&s.instance)
                .arg(ALIVE_FOR.as_micros() as u64)
                .arg(GRANT_TTL.as_micros() as u64)
                .arg(below)
                .arg(ids.len());
            for id in &ids {
                inv.arg(id);
            }
            let reply = s.call::<Vec<redis::Value>>(inv).await;
            let mut owed = vec![];
            let mut w = lock(&s.waiters);
            match reply {
                Ok(reply) => {
                    if let Some(b) = w.routes.get_mut(&keys[0]) {
                        b.failed = 0;
                    }
                    let count = |i: usize| {
                        reply
                            .get(i)
                            .and_then(|v| redis::from_redis_value::<usize>(v.clone()).ok())
                            .unwrap_or(0)
                    };
                    let (granted, charges) = (count(1), count(2));
                    if count(3) > 0 {
                        // Charges owed on the route: beat on until they are handed out.
                        if let Some(b) = w.routes.get_mut(&keys[0]) {
                            b.idle = 0;
                        }
                    }
                    let texts: Vec<String> = reply
                        .iter()
                        .skip(4)
                        .map(|v| redis::from_redis_value::<String>(v.clone()).unwrap_or_default())
                        .collect();
                    let (grants, rest) = texts.split_at(granted.min(texts.len()));
                    let (pairs, lost) = rest.split_at((2 * charges).min(rest.len()));
                    for id in grants {
                        w.deliver(id, Wake::Granted);
                    }
                    owed.extend(pairs.chunks(2).filter_map(|p| match p {
                        [id, charge] => Some((id.clone(), charge.clone())),
                        _ => None,
                    }));
                    for id in lost {
                        w.deliver(id, Wake::Requeue);
                    }
                }
                Err(e) => {
                    let failed = w.routes.get_mut(&keys[0]).map(|b| {
                        b.failed += 1;
                        b.failed
                    });
                    // The breaker open: the store is away for a while, do not keep anyone
                    // waiting on it.
                    if failed >= Some(2) || matches!(e, StoreError::BreakerOpen) {
                        // The route's queue is out of reach: its waiters enter again, which
                        // answers them by `store.on_error` while it stays so.
                        for id in ids {
                            w.deliver(&id, Wake::Requeue);
                        }
                    }
                }
            }
            drop(w);
            s.refund_owed(&keys, owed);
        }
    }
}
