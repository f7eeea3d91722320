//! The shared store: every instance of a fleet decides against the same Redis.
//!
//! - One Lua script call per request (`lua/store.lua`, operation `admit`) checks and charges the budget and takes the
//!   in-flight slots atomically, with Redis `TIME` as the clock: one round trip, and a refused
//!   request writes nothing.
//! - Slots are leases in sorted sets scored by expiry; long requests renew them every
//!   `lease_ttl/3`; a crashed instance's leases lapse after `lease_ttl`.
//! - Connections are multiplexed (concurrent requests share one socket) and live on the
//!   runtime that uses them: one per worker thread, created lazily, rebuilt after an error.
//! - Every call is bounded by `store.timeout`; a circuit breaker stops calling a dead Redis;
//!   while it is unreachable `store.on_error` decides. Nothing that charges is ever retried.
//! - A key refused for being over budget is refused locally, without a round trip, until the
//!   moment Redis said it could next fit (see [`DenyCache`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Script, ScriptInvocation};
use tokio::sync::Notify;

use super::memory::{Clock, MemoryStore};
use super::{lock, short_key, Admission, AdmitRequest, BudgetView, Charge, Lease, LeaseInner};
use crate::budget::{Limit, Outcome, Verdict};
use crate::config::{OnError, StoreSettings};
use crate::identity::KeyHash;
use crate::telemetry::metrics;

/// Consecutive failures that open the breaker.
const BREAKER_THRESHOLD: u32 = 3;
/// How long an open breaker waits before letting one probe through.
const BREAKER_OPEN_FOR: Duration = Duration::from_millis(500);
/// Back-off between retries for a route slot (jittered, doubling up to the max).
const QUEUE_POLL_MIN: Duration = Duration::from_millis(10);
const QUEUE_POLL_MAX: Duration = Duration::from_millis(200);
const DENY_SHARDS: usize = 32;

thread_local! {
    /// This thread's connection: (store id, connection).
    static CONN: RefCell<Option<(u64, MultiplexedConnection)>> = const { RefCell::new(None) };
    /// Held while this thread connects, so concurrent requests wait for one connection
    /// instead of each opening their own.
    static CONNECTING: Arc<tokio::sync::Mutex<()>> = Arc::new(tokio::sync::Mutex::new(()));
}

/// How long a call's reply is still awaited (in the background) after the request gave up on
/// it at `store.timeout`, to learn whether a timed-out admission was charged after all.
const LATE_REPLY_WAIT: Duration = Duration::from_secs(2);

static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
enum Fail {
    Timeout,
    Error(String),
    BreakerOpen,
}

/// Closed → (3 failures) → open for 500 ms → one probe → closed or open again.
///
/// The probe is whoever moves `open_until_us` forward first; there is no "probing" flag, so a
/// probe whose future is dropped mid-call (an aborted renewal, a client gone) only delays the
/// next probe by 500 ms instead of leaving the breaker open for good.
#[derive(Debug)]
struct Breaker {
    failures: AtomicU32,
    /// 0 when closed; otherwise when the next probe may go (µs since `epoch`).
    open_until_us: AtomicU64,
    epoch: Instant,
}

impl Breaker {
    fn new() -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            open_until_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64 + 1
    }

    fn allow(&self) -> bool {
        let until = self.open_until_us.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        let now = self.now_us();
        if now < until {
            return false;
        }
        // One probe per period: the caller that pushes the next probe time forward.
        self.open_until_us
            .compare_exchange(
                until,
                now + BREAKER_OPEN_FOR.as_micros() as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
        self.open_until_us.store(0, Ordering::Release);
    }

    fn failure(&self) {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= BREAKER_THRESHOLD {
            self.open_until_us.store(
                self.now_us() + BREAKER_OPEN_FOR.as_micros() as u64,
                Ordering::Release,
            );
        }
    }
}

/// Keys that Redis refused as over budget, with the moment Redis said they could next fit.
///
/// Safe because it can only refuse, never admit: until `until`, the bucket cannot have room for
/// `cost` units — levels only fall with time, and other instances can only add to them. A
/// refund elsewhere could make room a little sooner; the cache then refuses a little longer
/// than needed, never shorter. A config change invalidates an entry (its `Limit` differs).
#[derive(Debug)]
struct DenyCache {
    shards: Box<[Mutex<HashMap<u128, DenyEntry>>]>,
}

#[derive(Debug, Clone, Copy)]
struct DenyEntry {
    until: Instant,
    cost: u64,
    limit: Limit,
    remaining: u64,
    reset_at: Instant,
}

impl DenyCache {
    fn new() -> Self {
        DenyCache {
            shards: (0..DENY_SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    fn check(&self, req: &AdmitRequest) -> Option<Outcome> {
        let k = short_key(&req.key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        let e = *shard.get(&k)?;
        let now = Instant::now();
        if now >= e.until || e.limit != req.limit {
            shard.remove(&k);
            return None;
        }
        // A dearer request fits later: by the extra units' drain time.
        let extra_us = (req.cost.saturating_sub(e.cost))
            .saturating_mul(req.limit.per_unit)
            .div_ceil(req.limit.rate);
        (req.cost >= e.cost).then(|| Outcome {
            verdict: Verdict::Reject {
                retry_after_us: (e.until - now).as_micros() as u64 + extra_us,
            },
            state: None,
            remaining: e.remaining,
            reset_us: e.reset_at.saturating_duration_since(now).as_micros() as u64,
        })
    }

    /// This instance just charged the key (a cheaper request fitted): the cached figures are
    /// stale, so the next refusal is Redis's to make.
    fn forget(&self, req: &AdmitRequest) {
        let k = short_key(&req.key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        if !shard.is_empty() {
            shard.remove(&k);
        }
    }

    fn insert(&self, req: &AdmitRequest, o: &Outcome) {
        let Verdict::Reject { retry_after_us } = o.verdict else {
            return;
        };
        let now = Instant::now();
        let k = short_key(&req.key);
        let mut shard = lock(&self.shards[(k as usize) % DENY_SHARDS]);
        if shard.len() > 10_000 {
            shard.retain(|_, e| e.until > now);
        }
        shard.insert(
            k,
            DenyEntry {
                until: now + Duration::from_micros(retry_after_us),
                cost: req.cost,
                limit: req.limit,
                remaining: o.remaining,
                reset_at: now + Duration::from_micros(o.reset_us),
            },
        );
    }
}

pub struct RedisStore {
    id: u64,
    client: Result<redis::Client, String>,
    conn_config: AsyncConnectionConfig,
    timeout: Duration,
    on_error: OnError,
    fleet_size: u32,
    lease_ttl: Duration,
    /// Lease ids are `<instance>:<sequence>`: unique across the fleet.
    instance: String,
    lease_seq: AtomicU64,
    local: Arc<MemoryStore>,
    breaker: Breaker,
    degraded: AtomicBool,
    deny: DenyCache,
    /// `lua/store.lua`: every operation, selected by its first argument.
    script: Script,
    /// Wakes this instance's waiters for a route slot when one of its own leases is released.
    wake: Mutex<HashMap<Arc<str>, Arc<Notify>>>,
}

/// Leases a request holds in Redis; released explicitly or, failing that, on drop.
#[derive(Debug)]
pub struct RedisLease {
    store: Arc<RedisStore>,
    keys: Vec<String>,
    id: String,
    route: Arc<str>,
    renew: Option<tokio::task::AbortHandle>,
    released: bool,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").finish_non_exhaustive()
    }
}

impl RedisLease {
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

/// 60 bits of a SHA-256 in 10 URL-safe base64 characters.
fn tag(hash: &KeyHash) -> String {
    use base64::Engine;
    let mut s = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&hash[..8]);
    s.truncate(10);
    s
}

/// Store keys: a prefix (`t`), a hash tag holding 60 bits of the API key's SHA-256 (never the
/// key; one key's data shares a Redis Cluster slot), and a type letter. Kept to 14 characters:
/// that is what keeps a budget under 100 bytes of Redis memory (`MEMORY USAGE` 88).
fn budget_key(key: &KeyHash) -> String {
    format!("t{{{}}}b", tag(key))
}
fn key_slots_key(key: &KeyHash) -> String {
    format!("t{{{}}}f", tag(key))
}
fn route_slots_key(route: &str) -> String {
    format!(
        "t:r{{{}}}f",
        tag(&crate::identity::hash_key(route.as_bytes()))
    )
}

/// The arguments of one `admit` call, owned so that the call can outlive its request.
struct AdmitCall {
    budget: String,
    key_slots: Option<String>,
    route_slots: Option<String>,
    limit: Limit,
    cost: u64,
    key_cap: u32,
    route_cap: u32,
    lease_id: String,
}

enum Decided {
    Admitted(Outcome, Lease),
    OverBudget(Outcome),
    KeyBusy(Outcome),
    RouteBusy(Outcome),
}

impl RedisStore {
    pub fn new(s: &StoreSettings, clock: Clock) -> Arc<Self> {
        let client = redis::Client::open(s.url.as_str()).map_err(|e| e.to_string());
        if let Err(e) = &client {
            tracing::error!(error = %e, "store.url is not usable; running on store.on_error");
        }
        let conn_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(s.timeout.max(Duration::from_millis(100))))
            // Calls are bounded by store.timeout in `call`; the connection itself waits longer,
            // so that a late admission reply can still be seen and undone.
            .set_response_timeout(Some(LATE_REPLY_WAIT));
        Arc::new(RedisStore {
            id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed),
            client,
            conn_config,
            timeout: s.timeout,
            on_error: s.on_error,
            fleet_size: s.fleet_size.max(1),
            lease_ttl: s.lease_ttl,
            instance: format!("{:016x}", rand::random::<u64>()),
            lease_seq: AtomicU64::new(0),
            local: MemoryStore::new(clock),
            breaker: Breaker::new(),
            degraded: AtomicBool::new(false),
            deny: DenyCache::new(),
            script: Script::new(include_str!("lua/store.lua")),
            wake: Mutex::default(),
        })
    }

    pub fn degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// Ready unless Redis is unreachable and the policy is to refuse everything.
    pub fn ready(&self) -> bool {
        !(self.degraded() && self.on_error == OnError::Deny)
    }

    fn set_degraded(&self, on: bool) {
        if self.degraded.swap(on, Ordering::Relaxed) != on {
            metrics().store_degraded.set(on as i64);
            if on {
                tracing::warn!(policy = ?self.on_error, "store unreachable: deciding by store.on_error");
            } else {
                tracing::info!("store reachable again: shared budgets in force");
            }
        }
    }

    fn cached_conn(&self) -> Option<MultiplexedConnection> {
        CONN.with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(id, _)| *id == self.id)
                .map(|(_, conn)| conn.clone())
        })
    }

    /// This thread's connection, made on first use (on this thread's runtime). Connecting is
    /// bounded by `max(store.timeout, 100ms)`: a TCP (and TLS) handshake needs more than a call.
    async fn conn(&self) -> Result<MultiplexedConnection, Fail> {
        if let Some(c) = self.cached_conn() {
            return Ok(c);
        }
        let client = self.client.as_ref().map_err(|e| Fail::Error(e.clone()))?;
        let lock = CONNECTING.with(|l| l.clone());
        tokio::time::timeout(self.timeout.max(Duration::from_millis(100)), async {
            let _one_at_a_time = lock.lock().await;
            if let Some(c) = self.cached_conn() {
                return Ok(c);
            }
            let conn = client
                .get_multiplexed_async_connection_with_config(&self.conn_config)
                .await
                .map_err(|e| Fail::Error(e.to_string()))?;
            CONN.with(|c| *c.borrow_mut() = Some((self.id, conn.clone())));
            Ok(conn)
        })
        .await
        .map_err(|_| Fail::Timeout)?
    }

    fn forget_conn(&self) {
        CONN.with(|c| {
            let mut c = c.borrow_mut();
            if c.as_ref().is_some_and(|(id, _)| *id == self.id) {
                *c = None;
            }
        });
    }

    /// Metrics, breaker and connection health after one call.
    fn record<T>(&self, start: Instant, res: &Result<T, Fail>) {
        let m = metrics();
        m.store_duration.observe(start.elapsed().as_secs_f64());
        match res {
            Ok(_) => {
                m.store_calls.with_label_values(&["ok"]).inc();
                self.breaker.success();
                self.set_degraded(false);
            }
            Err(Fail::BreakerOpen) => {
                m.store_calls.with_label_values(&["breaker_open"]).inc();
            }
            Err(f) => {
                let label = match f {
                    Fail::Timeout => "timeout",
                    _ => "error",
                };
                m.store_calls.with_label_values(&[label]).inc();
                if let Fail::Error(msg) = f {
                    tracing::debug!(error = %msg, "store call failed");
                }
                // A timed-out or broken connection is not trusted again.
                self.forget_conn();
                self.breaker.failure();
            }
        }
    }

    /// Runs one script call under the timeout and the breaker, recording the outcome.
    /// For calls that charge nothing (leases, peeks, refunds); `admit` has its own.
    async fn call<T: redis::FromRedisValue>(
        &self,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<T, Fail> {
        if !self.breaker.allow() {
            let res = Err(Fail::BreakerOpen);
            self.record(Instant::now(), &res);
            return res;
        }
        let start = Instant::now();
        let res = async {
            let mut conn = self.conn().await?;
            match tokio::time::timeout(self.timeout, inv.invoke_async::<T>(&mut conn)).await {
                Err(_) => Err(Fail::Timeout),
                Ok(Err(e)) if e.is_timeout() => Err(Fail::Timeout),
                Ok(Err(e)) => Err(Fail::Error(e.to_string())),
                Ok(Ok(v)) => Ok(v),
            }
        }
        .await;
        self.record(start, &res);
        res
    }

    /// `refund`: gives `cost` units back to the budget at `key`.
    fn refund_op<'a>(&'a self, key: &'a str, limit: &Limit, cost: u64) -> ScriptInvocation<'a> {
        let mut inv = self.script.prepare_invoke();
        inv.key(key)
            .arg("refund")
            .arg(limit.per_unit)
            .arg(limit.rate)
            .arg(cost);
        inv
    }

    /// `lease`: renews lease `id` in `keys` for `ttl_us`, or releases it when `ttl_us` is 0.
    fn lease_op<'a>(
        &'a self,
        keys: impl IntoIterator<Item = &'a String>,
        id: &'a str,
        ttl_us: u64,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.script.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg("lease").arg(id).arg(ttl_us);
        inv
    }

    fn admit_invocation<'a>(&'a self, c: &'a AdmitCall) -> redis::ScriptInvocation<'a> {
        let mut inv = self.script.prepare_invoke();
        let l = &c.limit;
        // An unused slot key is passed as the budget key: the script never touches it.
        inv.key(&c.budget)
            .key(c.key_slots.as_ref().unwrap_or(&c.budget))
            .key(c.route_slots.as_ref().unwrap_or(&c.budget))
            .arg("admit")
            .arg(l.per_unit)
            .arg(l.rate)
            .arg(l.capacity)
            .arg(l.max_delay)
            .arg(c.cost)
            .arg(c.key_cap)
            .arg(c.route_cap)
            .arg(&c.lease_id)
            .arg(self.lease_ttl.as_micros() as u64);
        inv
    }

    /// The charging call. It runs in a task of its own: when it outlives `store.timeout` the
    /// request goes on without it (by `on_error`), and the task, if Redis admitted the request
    /// after all, gives the units and the slots back. So a timed-out request is never charged
    /// by Redis, and never charged twice (DESIGN §3); and it is never retried.
    async fn call_admit(self: &Arc<Self>, c: AdmitCall) -> Result<(Vec<i64>, AdmitCall), Fail> {
        if !self.breaker.allow() {
            let res = Err(Fail::BreakerOpen);
            self.record(Instant::now(), &res);
            return res;
        }
        let start = Instant::now();
        let mut conn = match self.conn().await {
            Ok(conn) => conn,
            Err(f) => {
                let res = Err(f);
                self.record(start, &res);
                return res;
            }
        };
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let store = self.clone();
        tokio::spawn(async move {
            let reply = store
                .admit_invocation(&c)
                .invoke_async::<Vec<i64>>(&mut conn)
                .await;
            if let Err((Ok(v), c)) = tx.send((reply, c)) {
                // The request stopped waiting: undo what Redis did for it.
                if v.first() == Some(&3) {
                    store.undo_admission(&c).await;
                }
            }
        });
        let remaining = self.timeout.saturating_sub(start.elapsed());
        let reply = match tokio::time::timeout(remaining, &mut rx).await {
            Ok(r) => r.ok(),
            Err(_) => {
                // A reply that arrived just now is still ours; after close(), the task keeps it.
                rx.close();
                rx.try_recv().ok()
            }
        };
        let res = match reply {
            None => Err(Fail::Timeout),
            Some((Err(e), _)) if e.is_timeout() => Err(Fail::Timeout),
            Some((Err(e), _)) => Err(Fail::Error(e.to_string())),
            Some((Ok(v), c)) => Ok((v, c)),
        };
        self.record(start, &res);
        res
    }

    /// Refunds and releases an admission whose request had already given up on it.
    async fn undo_admission(&self, c: &AdmitCall) {
        tracing::warn!("a timed-out admission reached Redis after all; refunding it");
        let Ok(mut conn) = self.conn().await else {
            return;
        };
        let refund = self.refund_op(&c.budget, &c.limit, c.cost);
        let _ = tokio::time::timeout(LATE_REPLY_WAIT, refund.invoke_async::<i64>(&mut conn)).await;
        if c.key_slots.is_some() || c.route_slots.is_some() {
            let release = self.lease_op(c.key_slots.iter().chain(&c.route_slots), &c.lease_id, 0);
            let _ =
                tokio::time::timeout(LATE_REPLY_WAIT, release.invoke_async::<i64>(&mut conn)).await;
        }
    }

    fn next_lease_id(&self) -> String {
        format!(
            "{}:{}",
            self.instance,
            self.lease_seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    async fn try_admit(self: &Arc<Self>, req: &AdmitRequest) -> Result<Decided, Fail> {
        let key_slots = req.key_cap.is_some();
        let route_slots = req.route_cap.is_some();
        let call = AdmitCall {
            budget: budget_key(&req.key),
            key_slots: key_slots.then(|| key_slots_key(&req.key)),
            route_slots: route_slots.then(|| route_slots_key(&req.route)),
            limit: req.limit,
            cost: req.cost,
            key_cap: req.key_cap.unwrap_or(0),
            route_cap: req.route_cap.unwrap_or(0),
            lease_id: if key_slots || route_slots {
                self.next_lease_id()
            } else {
                String::new()
            },
        };
        let (r, call) = self.call_admit(call).await?;
        let [code, a, remaining, reset_us] = r[..] else {
            return Err(Fail::Error(format!("unexpected script reply {r:?}")));
        };
        let (a, remaining, reset_us) = (
            a.max(0) as u64,
            remaining.max(0) as u64,
            reset_us.max(0) as u64,
        );
        let outcome = |verdict| Outcome {
            verdict,
            state: None,
            remaining,
            reset_us,
        };
        Ok(match code {
            0 => Decided::OverBudget(outcome(Verdict::Reject { retry_after_us: a })),
            1 => Decided::KeyBusy(outcome(Verdict::Admit { delay_us: 0 })),
            2 => Decided::RouteBusy(outcome(Verdict::Admit { delay_us: 0 })),
            _ => {
                let held: Vec<String> =
                    call.key_slots.into_iter().chain(call.route_slots).collect();
                let inner = if held.is_empty() {
                    LeaseInner::None
                } else {
                    let renew = self.spawn_renewal(held.clone(), call.lease_id.clone());
                    LeaseInner::Redis(RedisLease {
                        store: self.clone(),
                        keys: held,
                        id: call.lease_id,
                        route: req.route.clone(),
                        renew: Some(renew),
                        released: false,
                    })
                };
                Decided::Admitted(
                    outcome(Verdict::Admit { delay_us: a }),
                    Lease {
                        inner,
                        charge: Charge::Shared,
                    },
                )
            }
        })
    }

    /// Keeps a long request's leases alive: renewed every `lease_ttl / 3` until released.
    fn spawn_renewal(self: &Arc<Self>, keys: Vec<String>, id: String) -> tokio::task::AbortHandle {
        let store = self.clone();
        let every = self.lease_ttl / 3;
        let ttl_us = self.lease_ttl.as_micros() as u64;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let _ = store.call::<i64>(store.lease_op(&keys, &id, ttl_us)).await;
            }
        })
        .abort_handle()
    }

    async fn release_keys(&self, keys: &[String], id: &str) {
        if keys.is_empty() {
            return;
        }
        // A failed release is not retried: the lease lapses after lease_ttl.
        let _ = self.call::<i64>(self.lease_op(keys, id, 0)).await;
    }

    fn notify_for(&self, route: &Arc<str>) -> Arc<Notify> {
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

    pub async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Admission {
        if let Some(o) = self.deny.check(req) {
            return Admission::OverBudget(o);
        }
        let start = Instant::now();
        let mut backoff = QUEUE_POLL_MIN;
        loop {
            // Register for a local wake-up before asking, so a release in between isn't missed.
            let notify = req.route_cap.map(|_| self.notify_for(&req.route));
            let notified = notify.as_ref().map(|n| n.notified());
            match self.try_admit(req).await {
                Ok(Decided::Admitted(outcome, lease)) => {
                    self.deny.forget(req);
                    return Admission::Admitted {
                        outcome,
                        lease,
                        queued: start.elapsed(),
                    };
                }
                Ok(Decided::OverBudget(o)) => {
                    self.deny.insert(req, &o);
                    return Admission::OverBudget(o);
                }
                Ok(Decided::KeyBusy(o)) => return Admission::KeyBusy(o),
                Ok(Decided::RouteBusy(o)) => {
                    let waited = start.elapsed();
                    if waited >= req.queue_timeout {
                        return Admission::RouteBusy {
                            outcome: o,
                            queued: waited,
                        };
                    }
                    // Another instance's release is seen on the next poll; ours wakes us at once.
                    let jitter = rand::random_range(0.5..1.0);
                    let pause = backoff.mul_f64(jitter).min(req.queue_timeout - waited);
                    backoff = (backoff * 2).min(QUEUE_POLL_MAX);
                    match notified {
                        Some(n) => {
                            tokio::select! {
                                _ = n => {}
                                _ = tokio::time::sleep(pause) => {}
                            }
                        }
                        None => tokio::time::sleep(pause).await,
                    }
                }
                Err(_) => return self.fallback(req).await,
            }
        }
    }

    /// Decides by `store.on_error` while Redis cannot.
    async fn fallback(&self, req: &AdmitRequest) -> Admission {
        self.set_degraded(true);
        match self.on_error {
            OnError::Deny => Admission::Unavailable,
            OnError::Local => {
                // Each of fleet_size instances enforces its share of every budget and cap.
                let n = self.fleet_size;
                let share = |cap: u32| (cap / n).max(1);
                let mut r = req.clone();
                r.limit = req.limit.fraction(n);
                r.key_cap = req.key_cap.map(share);
                r.route_cap = req.route_cap.map(share);
                self.local.admit(&r).await
            }
            OnError::Allow => {
                // Admit everything; count it locally so the headers still say something true.
                let mut r = req.clone();
                r.key_cap = None;
                r.route_cap = None;
                match self.local.admit(&r).await {
                    a @ Admission::Admitted { .. } => a,
                    Admission::OverBudget(o)
                    | Admission::KeyBusy(o)
                    | Admission::RouteBusy { outcome: o, .. } => Admission::Admitted {
                        outcome: Outcome {
                            verdict: Verdict::Admit { delay_us: 0 },
                            ..o
                        },
                        lease: Lease::default(),
                        queued: Duration::ZERO,
                    },
                    Admission::Unavailable => Admission::Unavailable,
                }
            }
        }
    }

    /// Gives back a charge where it was made: in Redis, or in this instance's fallback store
    /// with the limit it was charged under. A failed Redis refund is not retried (it might
    /// have run) and never lands in the local store, which did not charge.
    pub async fn refund(&self, req: &AdmitRequest, charge: Charge) {
        self.deny.forget(req);
        match charge {
            Charge::None => {}
            Charge::Local(limit) => self.local.refund(&AdmitRequest {
                limit,
                ..req.clone()
            }),
            Charge::Shared => {
                let key = budget_key(&req.key);
                let _ = self
                    .call::<i64>(self.refund_op(&key, &req.limit, req.cost))
                    .await;
            }
        }
    }

    pub async fn peek(&self, key: &KeyHash, limit: &Limit) -> Option<BudgetView> {
        let k = budget_key(key);
        let mut inv = self.script.prepare_invoke();
        inv.key(&k).arg("peek").arg(limit.rate);
        let level: i64 = self.call(inv).await.ok()?;
        Some(BudgetView::at(limit, level.max(0) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_a_hash_tag_and_no_raw_key() {
        let h = crate::identity::hash_key(b"secret-key");
        let k = budget_key(&h);
        assert!(k.starts_with("t{") && k.ends_with("}b"), "{k}");
        assert_eq!(k.len(), 14);
        assert!(!k.contains("secret"));
        assert_eq!(&key_slots_key(&h)[..13], &k[..13], "same slot");
    }

    #[test]
    fn breaker_opens_after_failures_and_probes() {
        let b = Breaker::new();
        for _ in 0..BREAKER_THRESHOLD {
            assert!(b.allow());
            b.failure();
        }
        assert!(!b.allow(), "open");
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        // The probe's future was dropped: neither success nor failure is reported. The breaker
        // still lets the next probe through one period later.
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow(), "next probe after a lost one");
        b.failure();
        assert!(!b.allow(), "probe failed: open again");
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow());
        b.success();
        assert!(b.allow() && b.allow(), "closed");
    }

    #[test]
    fn deny_cache_only_refuses_until_redis_said() {
        let c = DenyCache::new();
        let req = AdmitRequest {
            key: [1; 32],
            limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
            cost: 20,
            key_cap: None,
            route: Arc::from("r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
        };
        assert!(c.check(&req).is_none());
        let o = Outcome {
            verdict: Verdict::Reject {
                retry_after_us: 50_000,
            },
            state: None,
            remaining: 5,
            reset_us: 60_000_000,
        };
        c.insert(&req, &o);
        assert!(c.check(&req).is_some());
        // A cheaper request might fit sooner: not cached.
        let cheap = AdmitRequest {
            cost: 1,
            ..req.clone()
        };
        assert!(c.check(&cheap).is_none());
        // A different limit (reload): not cached.
        let other = AdmitRequest {
            limit: Limit::new(600, Duration::from_secs(60), Duration::ZERO).unwrap(),
            ..req.clone()
        };
        assert!(c.check(&other).is_none());
        c.insert(&req, &o);
        assert!(c.check(&req).is_some());
        std::thread::sleep(Duration::from_millis(60));
        assert!(c.check(&req).is_none(), "expired");
    }
}
