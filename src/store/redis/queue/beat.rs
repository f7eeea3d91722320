//! The instance's side of its routes' queues: who waits here, the grants Redis publishes to
//! this instance, and the beat that keeps its waiters alive in each queue and tells the queue
//! every id it has there (so that the queue drops what a failover made it remember wrongly).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::super::conn::subscribed;
use super::super::guard::Guard;
use super::super::keys::{queue_keys, QueueKeys};
use super::super::script::Call;
use super::{ALIVE_FOR, GRANT_TTL};
use crate::store::redis::RedisBackend;
use crate::store::{lock, StoreError};

/// How often an instance with waiters on a route beats there.
const BEAT_EVERY: Duration = Duration::from_millis(500);
/// Beats on a route after this instance's last waiter there left.
const IDLE_BEATS: u32 = 10;

/// The fleet's routes with waiters: a sorted set, route lease set → when an instance with
/// waiters there last said so (ms since the epoch). Every instance looks at it every
/// [`SWEEP_EVERY`] and beats once on each route it does not beat on itself: a killed
/// instance's waiters are dropped and their charges handed out for refund (DESIGN §8) even
/// when no live instance waits on their route. Its own key (on Cluster, a slot of its own).
const WAITED_ON: &str = "t:qw";
/// How often an instance with waiters on a route says so in [`WAITED_ON`].
const REGISTER_EVERY: Duration = Duration::from_secs(10);
/// How long a route stays in [`WAITED_ON`] after it was last said to have waiters: long
/// enough for its dead instances' waiters to be dropped (2 s), owed (5 s) and handed out
/// (again every 30 s until paid). Scores are each instance's clock: instances whose clocks
/// differ by less than this less [`REGISTER_EVERY`] keep each other's entries.
const REGISTERED_FOR: Duration = Duration::from_secs(300);
const SWEEP_EVERY: Duration = Duration::from_secs(5);
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
    /// When Redis last answered a beat here, or queued a waiter of this instance here.
    answered: Instant,
    /// Beats since the last waiter here left.
    idle: u32,
    /// When this instance last said in [`WAITED_ON`] that it has waiters here (`None` while
    /// it has none: the next one says so at once).
    registered: Option<Instant>,
}

impl Beating {
    /// Whether to say now in [`WAITED_ON`] that this instance has waiters here: at its first
    /// waiter, then every [`REGISTER_EVERY`] while it has any.
    fn due(&mut self, now: Instant) -> bool {
        if self.waiting == 0 {
            self.registered = None;
            return false;
        }
        if self
            .registered
            .is_some_and(|at| now.duration_since(at) < REGISTER_EVERY)
        {
            return false;
        }
        self.registered = Some(now);
        true
    }
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
    /// Pending ids held for their `max_delay` turn, not entering yet: a route where this
    /// instance has only those is still swept by it (`sweep`).
    pub(in crate::store::redis) holding: std::collections::HashSet<String>,
    running: bool,
}

impl Waiters {
    pub(super) fn deliver(&mut self, id: &str, wake: Wake) {
        if let Some((_, tx)) = self.waiting.remove(id) {
            let _ = tx.send(wake);
        }
    }

    /// Delivers what a beat's reply says of this instance's waiters: their grants, and those
    /// the queue lost (to enter again).
    fn heard(&mut self, reply: &BeatReply) {
        for id in &reply.granted {
            self.deliver(id, Wake::Granted);
        }
        for id in &reply.lost {
            self.deliver(id, Wake::Requeue);
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
        // It waits once Redis queued it: Redis answered on the route just now.
        if let Some(b) = w.routes.get_mut(&keys[0]) {
            b.answered = Instant::now();
        }
        w.waiting.insert(id.to_string(), (keys[0].clone(), tx));
        let due = w.routes.get_mut(&keys[0]).is_some_and(|b| {
            b.waiting += 1;
            b.due(Instant::now())
        });
        drop(w);
        if due {
            // Said at once, not at the next beat: an instance killed a moment after its
            // first waiter came has its waiters refunded too.
            let store = self.clone();
            let route = keys[0].clone();
            tokio::spawn(async move { store.register_waited_on(vec![route]).await });
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
                answered: Instant::now(),
                idle: 0,
                registered: None,
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
        let mut register = vec![];
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
            let now = Instant::now();
            for b in w.routes.values_mut() {
                if b.due(now) {
                    register.push(b.keys[0].clone());
                }
            }
            w.routes.values().map(|b| b.keys.clone()).collect()
        };
        if !register.is_empty() {
            s.register_waited_on(register).await;
        }
        for keys in routes {
            let (below, ids) = s.ids_on_route(&keys[0]);
            let reply = s
                .call::<Vec<redis::Value>>(s.beat_call(&keys, below, &ids))
                .await;
            let mut owed = vec![];
            let mut w = lock(&s.waiters);
            match reply {
                Ok(reply) => {
                    let reply = BeatReply::of(&reply);
                    if let Some(b) = w.routes.get_mut(&keys[0]) {
                        b.failed = 0;
                        b.answered = Instant::now();
                        if reply.owing > 0 {
                            // Charges owed on the route: beat on until they are handed out.
                            b.idle = 0;
                        }
                    }
                    w.heard(&reply);
                    owed = reply.owed;
                }
                Err(e) => {
                    let failing = w.routes.get_mut(&keys[0]).map(|b| {
                        b.failed += 1;
                        (b.failed, b.answered.elapsed())
                    });
                    let gone = failing.is_some_and(|(failed, failing_for)| {
                        match s.waiters_outlast {
                            // The breaker open: the store is away for a while, do not keep
                            // anyone waiting on it.
                            None => failed >= 2 || matches!(e, StoreError::BreakerOpen),
                            // `deny` would refuse them: they wait a blip out instead (their
                            // places and charges are Redis's; a beat once it answers again
                            // names them, and any it dropped meanwhile are taken back).
                            Some(outlast) => failing_for >= outlast,
                        }
                    });
                    if gone {
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

/// A `beat`'s reply (`lua/queue.lua`): `{w, g, o, p, granted…, (id, charge)…, lost…}`.
struct BeatReply {
    granted: Vec<String>,
    /// Charges owed and due, now the caller's to refund.
    owed: Vec<(String, String)>,
    lost: Vec<String>,
    /// Charges owed on the route, due or not.
    owing: usize,
}

impl BeatReply {
    fn of(reply: &[redis::Value]) -> BeatReply {
        let count = |i: usize| {
            reply
                .get(i)
                .and_then(|v| redis::from_redis_value::<usize>(v.clone()).ok())
                .unwrap_or(0)
        };
        let (granted, charges) = (count(1), count(2));
        let texts: Vec<String> = reply
            .iter()
            .skip(4)
            .map(|v| redis::from_redis_value::<String>(v.clone()).unwrap_or_default())
            .collect();
        let (grants, rest) = texts.split_at(granted.min(texts.len()));
        let (pairs, lost) = rest.split_at((2 * charges).min(rest.len()));
        BeatReply {
            granted: grants.to_vec(),
            owed: pairs
                .chunks(2)
                .filter_map(|p| match p {
                    [id, charge] => Some((id.clone(), charge.clone())),
                    _ => None,
                })
                .collect(),
            lost: lost.to_vec(),
            owing: count(3),
        }
    }
}

impl RedisBackend {
    /// A `beat` on the route of `keys` as this instance, naming the `ids` it has there (and
    /// with `below` > 0, letting the queue drop its others from before it).
    fn beat_call<'a>(&'a self, keys: &QueueKeys, below: u64, ids: &[String]) -> Call<'a> {
        let mut inv = self.queue_script.call(keys, "beat");
        inv.arg(&self.instance)
            .arg(ALIVE_FOR.as_micros() as u64)
            .arg(GRANT_TTL.as_micros() as u64)
            .arg(below)
            .arg(ids.len());
        for id in ids {
            inv.arg(id);
        }
        inv
    }

    /// Says in [`WAITED_ON`] that this instance has waiters on `routes` (lease sets); one
    /// that fails is said again at the next beat.
    async fn register_waited_on(&self, routes: Vec<String>) {
        let now = crate::unix_ms();
        let said = self
            .guarded(Guard::Bypass(self.timeout), |mut conn| {
                let mut pipe = redis::pipe();
                let add = pipe.cmd("ZADD").arg(WAITED_ON);
                for route in &routes {
                    add.arg(now).arg(route);
                }
                // Like every tollgate key, it expires (an idle fleet leaves nothing behind).
                pipe.cmd("PEXPIRE")
                    .arg(WAITED_ON)
                    .arg(REGISTERED_FOR.as_millis() as u64);
                async move { Ok(pipe.query_async::<(i64, i64)>(&mut conn).await?) }
            })
            .await;
        if said.is_err() {
            let mut w = lock(&self.waiters);
            for route in &routes {
                if let Some(b) = w.routes.get_mut(route) {
                    b.registered = None;
                }
            }
        }
    }

    /// Looks at the fleet's routes with waiters every [`SWEEP_EVERY`], for as long as the
    /// store lives ([`Self::sweep_waited_on`]).
    pub(in crate::store::redis) fn spawn_queue_sweep(self: &Arc<Self>) {
        let store = Arc::downgrade(self);
        let spawned = crate::background::spawn("tollgate-queue-sweep".into(), move || async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                let Some(s) = store.upgrade() else { return };
                s.sweep_waited_on().await;
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the queue sweep: a killed instance's waiters are refunded only where another instance waits");
        }
    }

    /// Beats once on each route of [`WAITED_ON`] this instance does not beat on itself, as an
    /// instance with nothing there: the queue drops the waiters of instances that stopped
    /// beating, and hands out the charges they owe, which this instance refunds. Routes not
    /// said to have waiters for [`REGISTERED_FOR`] leave the set. Past the breaker and
    /// uncounted, as the other upkeep is.
    async fn sweep_waited_on(self: &Arc<Self>) {
        let stale = crate::unix_ms().saturating_sub(REGISTERED_FOR.as_millis() as u64);
        let listed = self
            .guarded(Guard::Bypass(self.timeout), |mut conn| async move {
                let mut trim = redis::cmd("ZREMRANGEBYSCORE");
                trim.arg(WAITED_ON).arg("-inf").arg(format!("({stale}"));
                trim.query_async::<i64>(&mut conn).await?;
                let mut all = redis::cmd("ZRANGE");
                all.arg(WAITED_ON).arg(0).arg(-1);
                Ok(all.query_async::<Vec<String>>(&mut conn).await?)
            })
            .await;
        let Ok(routes) = listed else { return };
        for route in routes {
            {
                // Its own beats cover a route where it waits or is entering a waiter (its
                // grants there are for those beats to deliver).
                let w = lock(&self.waiters);
                let entering = |(id, r): (&String, &String)| *r == route && !w.holding.contains(id);
                if w.routes.contains_key(&route) || w.pending.iter().any(entering) {
                    continue;
                }
            }
            let Some(keys) = queue_keys(&route) else {
                continue;
            };
            // `below` 0, no ids: nothing of this instance's own is dropped (it has nothing
            // there, or is entering its first waiter this moment).
            let inv = self.beat_call(&keys, 0, &[]);
            let beat = self
                .call_guarded::<Vec<redis::Value>>(Guard::Bypass(self.timeout), inv)
                .await;
            if let Ok(reply) = beat {
                let reply = BeatReply::of(&reply);
                // A grant to a waiter that entered meanwhile is delivered, not lost.
                lock(&self.waiters).heard(&reply);
                self.refund_owed(&keys, reply.owed);
            }
        }
    }
}
