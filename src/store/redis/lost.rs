//! Redis lost its data (a restart without persistence, a failover to an empty replica, a
//! FLUSHALL): the leases every instance holds are gone with it, and their slots look free.
//! A new Redis process has a new `run_id`. Each instance reads it on every new connection
//! and, while it holds leases, every [`CHECK_EVERY`]; on Cluster, each primary's, by its
//! address (a primary restarted empty at its address; a replica promoted
//! in its place has another address, and its data if it was in sync; a synced replica
//! promoted back at its old address is taken for one that lost its data: its leases are
//! registered again, and requests that take a slot wait [`SETTLE_FOR`], needlessly). On a
//! new one:
//!
//! - an instance registers every lease it holds again before its next admission (a renewal
//!   re-creates a missing lease, `lua/store/lease.lua`), at once and bypassing the breaker;
//! - and holds back its own requests that would take a slot for [`SETTLE_FOR`]: long enough
//!   for every other instance holding leases to have seen the new `run_id` and registered
//!   them again, so that nobody fills the cap beside them.
//!
//! An instance that never saw another `run_id` (its first connection) holds nothing back. A
//! request that takes a slot gets its thread's connection before it asks whether to hold
//! back: the connection a thread makes after a restart is what reads the new `run_id`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::guard::Guard;
use super::lease::Sets;
use super::script::{AdmitCall, Lease};
use super::RedisBackend;
use crate::store::{lock, AdmitRequest, StoreError};

/// How often `run_id` is read while leases are held.
const CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long requests that take a slot wait after a new `run_id` was seen.
const SETTLE_FOR: Duration = Duration::from_secs(2);

/// What this instance knows of the Redis process it talks to (on Cluster, of each primary).
#[derive(Debug, Default)]
pub(super) struct RunId {
    /// Each process's `run_id` by its node's address (one entry, "", but on Cluster).
    known: Mutex<HashMap<String, String>>,
    /// When a new `run_id` was last seen.
    changed_at: Mutex<Option<Instant>>,
    /// Set on a new `run_id`, until every lease held is registered again.
    leases_lost: AtomicBool,
}

impl RunId {
    /// Reads `run_id` on `conn` and notes it: `Some(true)` if it is new (another one was
    /// known), `None` if it could not be read.
    /// On Cluster, `INFO` goes to every primary and answers a map of their addresses to their
    /// answers: each is noted by its address.
    pub(super) async fn read<C: redis::aio::ConnectionLike>(&self, conn: &mut C) -> Option<bool> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server");
        let info = cmd.query_async::<redis::Value>(conn);
        let Ok(Ok(info)) = tokio::time::timeout(Duration::from_millis(100), info).await else {
            return None;
        };
        let ids = run_ids(info);
        if ids.is_empty() {
            return None;
        }
        let mut known = lock(&self.known);
        let mut new = false;
        for (node, id) in ids {
            match known.get(&node) {
                Some(k) if *k == id => {}
                had => {
                    new |= had.is_some();
                    known.insert(node, id);
                }
            }
        }
        drop(known);
        if new {
            *lock(&self.changed_at) = Some(Instant::now());
            self.leases_lost.store(true, Ordering::Release);
            tracing::warn!("Redis is a new process (a new run_id): its data may be gone; leases are registered again");
        }
        Some(new)
    }

    /// Redis answered again after answering nothing for `quiet` (a stall, a partition): its
    /// clock ran on meanwhile, and a lease renewed every third of `lease_ttl` may have lapsed
    /// by it once `quiet` reaches half of it, or a second if that is longer. As after a new
    /// `run_id`: leases are registered again, and requests that take a slot wait while the
    /// other instances do the same (meanwhile `lua/queue.lua`'s `wake` keeps a route's lapsed
    /// leases, by the same measure, for callers with a stake there or the fleet's queued jobs).
    pub(super) fn answered_after(&self, quiet: Duration, lease_ttl: Duration) {
        if quiet < (lease_ttl / 2).max(Duration::from_secs(1)) {
            return;
        }
        *lock(&self.changed_at) = Some(Instant::now());
        self.leases_lost.store(true, Ordering::Release);
        tracing::warn!(
            silent_s = quiet.as_secs_f64(),
            "Redis answers again after a silence of half the lease time or more: leases may have lapsed by its clock; they are registered again"
        );
    }

    /// Whether a new `run_id` was seen after `t`: Redis may have lost its data since.
    pub(super) fn changed_since(&self, t: Instant) -> bool {
        lock(&self.changed_at).is_some_and(|at| at > t)
    }

    /// How long a request that takes a slot still waits for other instances to register
    /// their leases again.
    fn settling(&self) -> Option<Duration> {
        let at = (*lock(&self.changed_at))?;
        SETTLE_FOR
            .checked_sub(at.elapsed())
            .filter(|d| !d.is_zero())
    }
}

/// The `run_id`s an `INFO server` answer names, by node address: one node's text (address
/// ""), or a Cluster's map of each primary's address to its text (a primary that answered
/// an error is left out).
fn run_ids(info: redis::Value) -> Vec<(String, String)> {
    let of = |v: &redis::Value| -> Option<String> {
        let text = match v {
            redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?,
            redis::Value::VerbatimString { text, .. } => text.as_str(),
            redis::Value::SimpleString(s) => s.as_str(),
            _ => return None,
        };
        let id = text.lines().find_map(|l| l.strip_prefix("run_id:"))?;
        Some(id.trim().to_string())
    };
    match &info {
        redis::Value::Map(nodes) => nodes
            .iter()
            .filter_map(|(node, v)| {
                let node = <String as redis::FromRedisValue>::from_redis_value_ref(node).ok()?;
                Some((node, of(v)?))
            })
            .collect(),
        single => of(single)
            .map(|id| (String::new(), id))
            .into_iter()
            .collect(),
    }
}

impl RedisBackend {
    /// Starts the `run_id` check unless it runs (called when a lease is taken).
    pub(super) fn watch_for_data_loss(self: &Arc<Self>) {
        if self.watching_run_id.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.watching_run_id.store(false, Ordering::Release);
            return;
        };
        rt.spawn(check_while_leased(Arc::downgrade(self)));
    }

    /// Registers every lease this instance holds again, bypassing the breaker (a renewal
    /// re-creates a missing one: in a capped route's queue as its key's, so that the key's
    /// share of the route counts it). True when all of them went.
    async fn reregister_leases(&self) -> Result<(), StoreError> {
        let live: Vec<(String, Sets)> = lock(&self.held)
            .live
            .iter()
            .map(|(id, held)| (id.clone(), held.clone()))
            .collect();
        let within = self.timeout.max(Duration::from_millis(200));
        for (id, held) in &live {
            self.renew(held, id, Guard::Bypass(within)).await?;
        }
        if !live.is_empty() {
            tracing::warn!(
                leases = live.len(),
                "registered this instance's leases again after Redis lost its data or answered nobody"
            );
        }
        Ok(())
    }

    /// Before an admission: leases lost with Redis's data are registered again first, and a
    /// request that takes a slot waits while other instances do the same (a capped route's
    /// request counts the wait in its `queue_timeout`: `admit_capped`).
    pub(super) async fn after_data_loss(&self, req: &AdmitRequest) {
        let ids = &self.conns.run_id;
        if ids.leases_lost.load(Ordering::Acquire) && self.reregister_leases().await.is_ok() {
            ids.leases_lost.store(false, Ordering::Release);
        }
        if req.route_cap.is_some() || req.key_cap.is_some() {
            // This thread's connection first: one made now (the first since a restart) is
            // what reads the new `run_id`, and the hold must know of it. Not while the
            // breaker is open: the admission is refused without connecting then.
            if self.breaker.closed() {
                let _ = self.conns.get().await;
            }
            if let Some(wait) = ids.settling() {
                tokio::time::sleep(wait).await;
            }
        }
    }

    /// Whether admission `c`, which took a slot of its key's `max_in_flight_per_key`, must be
    /// given back because Redis was seen anew during its call (asked at `asked`): its
    /// thread's connection to the old process looked open, the charge went again on a new
    /// one, and that read the new `run_id` only then, after [`Self::after_data_loss`] let it
    /// through. It waits as a request that saw the new `run_id` first does, then counts its
    /// key's leases (its own renewed among them): over the cap, beside the leases the others
    /// registered again meanwhile, it is undone (charge and slot) and true. A count Redis
    /// does not answer keeps it (as any admission on a store that fails: DESIGN §4's bound).
    /// The wait and the count run in a task of their own, so that a request that goes away
    /// meanwhile (its future dropped) leaves nothing held: whatever it was not told is undone.
    pub(super) async fn over_key_cap_after_loss(
        self: &Arc<Self>,
        req: &AdmitRequest,
        c: &AdmitCall,
        asked: Instant,
    ) -> bool {
        if req.key_cap.is_none() || c.key_slots.is_none() || !self.conns.run_id.changed_since(asked)
        {
            return false;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (store, req, call) = (self.clone(), req.clone(), c.clone());
        tokio::spawn(async move {
            let over = store.recount_key_slots(&req, &call).await;
            if tx.send(over).is_err() && !over {
                store.undo_admission(&call, 0).await;
            }
        });
        let mut told = Told {
            rx,
            store: self.clone(),
            call: c.clone(),
        };
        (&mut told.rx).await.unwrap_or(false)
    }

    /// [`Self::over_key_cap_after_loss`]'s wait and count: true when over the cap (undone).
    async fn recount_key_slots(self: &Arc<Self>, req: &AdmitRequest, c: &AdmitCall) -> bool {
        let (Some(cap), Some(set)) = (req.key_cap, &c.key_slots) else {
            return false;
        };
        self.after_data_loss(req).await;
        let renew = Lease {
            sets: std::slice::from_ref(set),
            id: &c.lease_id,
            ttl_us: c.lease_ttl_us,
        };
        match self.op_repeatable(&renew).await {
            Ok(live) if live > i64::from(cap) => {
                tracing::warn!(
                    "a request took its key's slot as Redis came back empty: given back (429)"
                );
                self.undo_admission(c, 0).await;
                true
            }
            _ => false,
        }
    }
}

/// The request's end of a recount: dropped before it read "kept", the admission is undone
/// (the task undoes it itself when it could not tell anyone).
struct Told {
    rx: tokio::sync::oneshot::Receiver<bool>,
    store: Arc<RedisBackend>,
    call: AdmitCall,
}

impl Drop for Told {
    fn drop(&mut self) {
        self.rx.close();
        if let (Ok(false), Ok(rt)) = (self.rx.try_recv(), tokio::runtime::Handle::try_current()) {
            let (store, call) = (self.store.clone(), self.call.clone());
            rt.spawn(async move { store.undo_admission(&call, 0).await });
        }
    }
}

async fn check_while_leased(store: Weak<RedisBackend>) {
    // When `run_id` was last read: a read after a long silence is Redis answering again.
    let mut read_at = Instant::now();
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        let Some(s) = store.upgrade() else { return };
        if lock(&s.held).live.is_empty() {
            s.watching_run_id.store(false, Ordering::Release);
            // A lease taken just now started no check (this one still ran): go on for it.
            if lock(&s.held).live.is_empty() || s.watching_run_id.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        let read = match s.conns.get().await {
            Ok(mut conn) => s.conns.run_id.read(&mut conn).await,
            Err(_) => None,
        };
        let ids = &s.conns.run_id;
        match read {
            // Silent for the time since the last read, but the period between two reads.
            Some(_) => {
                ids.answered_after(read_at.elapsed().saturating_sub(CHECK_EVERY), s.lease_ttl);
                read_at = Instant::now();
            }
            // A connection that broke (Redis restarted) is made again on the next look. (On
            // Cluster too: a read fails whole while one primary is down, and the connection
            // made anew is what reaches it once it is back.)
            None => s.conns.forget(),
        }
        if ids.leases_lost.load(Ordering::Acquire) {
            match s.reregister_leases().await {
                Ok(()) => {
                    ids.leases_lost.store(false, Ordering::Release);
                    // Redis answered all along (registering many takes a while).
                    read_at = Instant::now();
                }
                Err(e) => tracing::debug!(error = %e, "leases not registered again yet"),
            }
        }
    }
}
