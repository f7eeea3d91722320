//! The shared store: every instance of a fleet decides against the same Redis.
//!
//! - One Lua script call per request (`script`, `lua/store/admit.lua`) checks and charges the
//!   budget and takes the in-flight slots atomically, with Redis `TIME` as the clock: one round
//!   trip, and a refused request writes nothing. On Redis Cluster a capped route's lease set
//!   lives in a slot of its own, so such a request takes two (`run_admit`).
//! - Slots are leases (`lease`); connections are per worker thread (`conn`); keys are laid
//!   out in `keys`.
//! - Every call is bounded by `store.timeout`; a circuit breaker (`breaker`) stops calling a
//!   dead Redis (both in `guard`, the one way a call reaches Redis). Nothing that charges is ever retried. What to do while Redis cannot decide is
//!   not this module's business: it answers with a [`StoreError`] and `store::fallback`
//!   applies `store.on_error`.
//! - A key refused for being over budget is refused locally, without a round trip, until the
//!   moment Redis said it could next fit (`deny_cache`).
//! - With `store.slices`, a busy key reserves a slice of its budget in the same `admit` call
//!   and spends it here, without round trips (`slices`): Redis holds the slice, undrained,
//!   until this instance settles it. Only for requests without in-flight caps, route-shared
//!   budgets or `max_delay`, and never near the end of a budget.

mod admit;
mod batch;
mod breaker;
mod conn;
mod deny_cache;
mod eviction;
mod guard;
mod jobs;
pub mod keys;
mod lease;
mod lost;
mod queue;
mod script;
mod sentinel;
mod shared;
mod sliced;
mod slices;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use conn::UnusableUrl;
pub(crate) use jobs::{JobCharge, JobEntered};
pub use lease::RedisLease;
pub use script::script_sha;

/// The key's tag, as Redis's keys and a route's queue name it.
pub(crate) fn key_tag(key: &KeyHash) -> String {
    keys::key_tag(key)
}
pub(super) use script::may_have_run;

use super::fallback::{FallbackStore, SharedAnswer};
use super::memory::{Clock, MemoryStore};
use super::{Admission, AdmitRequest, Bucket, Lease, Standing, StoreError};
use crate::budget::{Limit, Outcome, Verdict};
use crate::config::StoreSettings;
use crate::identity::KeyHash;
use breaker::Breaker;
use conn::Connections;
use deny_cache::DenyCache;
use script::{AdmitCall, AdmitCode};
use slices::{Ask, Seen, Slices};

/// The gateway's store for a fleet: Redis, with `store.on_error` deciding while it cannot.
pub type RedisStore = FallbackStore<RedisBackend>;

impl RedisStore {
    /// Never fails, and connects in the background: the gateway starts while Redis is down.
    pub fn new(s: &StoreSettings, clock: Clock) -> Arc<Self> {
        let backend = RedisBackend::new(s);
        backend.spawn_eviction_check();
        backend.spawn_give_back_listener();
        backend.spawn_queue_sweep();
        let store = FallbackStore::over(backend, MemoryStore::new(clock), s.on_error, s.fleet_size);
        store.spawn_probe();
        store
    }
}

/// How long a call's reply is still awaited (in the background) after the request gave up on
/// it at `store.timeout`, to learn whether a timed-out admission was charged after all.
const LATE_REPLY_WAIT: Duration = Duration::from_secs(2);

/// How often a refund that Redis refused unrun is sent again: at first, and after backing off.
const REFUND_RETRY_EVERY: Duration = Duration::from_millis(200);
const REFUND_RETRY_BACKED_OFF: Duration = Duration::from_secs(2);
/// The longest a refund that did not run is sent again.
const REFUND_RETRY_AT_MOST: Duration = Duration::from_secs(3600);

/// Redis as a [`SharedStore`].
pub struct RedisBackend {
    conns: Connections,
    timeout: Duration,
    lease_ttl: Duration,
    /// How long this instance's waiters keep their places while their route's beats fail:
    /// under `on_error: deny`, [`queue::DENY_WAITS_OUT`] (nothing is decided for them
    /// meanwhile, and Redis keeps their places and charges). `None`: they enter again after
    /// two failed beats, and `store.on_error` answers them (`local` runs them on this
    /// instance's share, `allow` at once).
    waiters_outlast: Option<Duration>,
    /// Lease ids are `<instance>:<sequence>`: unique across the fleet.
    instance: String,
    lease_seq: AtomicU64,
    breaker: Breaker,
    deny: DenyCache,
    /// Leases held, and releases still owed to Redis.
    held: Mutex<lease::Held>,
    /// Budget slices this instance holds (`store.slices`; never any when off).
    slices: Slices,
    slices_on: bool,
    /// Redis's `TIME` of the last `admit` it answered (µs): lets a test replay Redis's
    /// decisions on the memory store at the very same instants.
    last_decided_us: AtomicU64,
    queue_script: queue::QueueScript,
    /// This instance's requests waiting in a route's queue.
    waiters: Mutex<queue::Waiters>,
    /// The `run_id` check runs (while leases are held: `lost`).
    watching_run_id: AtomicBool,
    /// Async jobs' records (`lua/jobs.lua`).
    job_script: jobs::JobScript,
    /// Each worker thread's admissions in flight and waiting (group commit: `batch`).
    lanes: thread_local::ThreadLocal<Arc<batch::Lane>>,
    /// This instance's held requests (`crate::hold`): a capped request waits its `max_delay`
    /// turn there before it enters its route's queue.
    holds: std::sync::OnceLock<crate::hold::Holds>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend").finish_non_exhaustive()
    }
}

/// Redis's answer to one `admit` call.
enum Decided {
    Admitted(Outcome, Lease),
    /// A capped request's key side passed (charged; the key's lease sets and the lease id to
    /// hold): its route's queue comes next (`queue`).
    KeyAdmitted(Outcome, Vec<String>, String),
    OverBudget(Outcome),
    KeyBusy(Standing),
    RouteBusy(Standing),
}

impl RedisBackend {
    /// The answer to a request as Redis decided it (not queued for a slot).
    fn answer(&self, req: &AdmitRequest, decided: Decided, start: Instant) -> SharedAnswer {
        let admission = match decided {
            Decided::Admitted(outcome, lease) => {
                self.deny.forget(&req.key);
                Admission::admitted(&outcome, lease, Duration::ZERO)
            }
            Decided::KeyAdmitted(outcome, ..) => {
                // Not reached: a capped request's key side is answered by `admit_capped`.
                Admission::admitted(&outcome, Lease::shared(None), Duration::ZERO)
            }
            Decided::OverBudget(o) => {
                self.deny.insert(req, &o, start);
                Admission::over_budget(&o)
            }
            Decided::KeyBusy(o) => Admission::KeyBusy(o),
            Decided::RouteBusy(o) => Admission::RouteBusy {
                standing: o,
                queued: start.elapsed(),
                full: false,
            },
        };
        SharedAnswer {
            admission,
            reached: true,
        }
    }
}

impl RedisBackend {
    pub fn new(s: &StoreSettings) -> Arc<Self> {
        let instance = rand::random::<u64>();
        Arc::new(RedisBackend {
            // The connection itself waits longer than a call, so that a late admission reply
            // can still be seen and undone.
            conns: Connections::new(&s.url, s.timeout, LATE_REPLY_WAIT),
            timeout: s.timeout,
            lease_ttl: s.lease_ttl,
            waiters_outlast: (s.on_error == crate::config::OnError::Deny)
                .then_some(queue::DENY_WAITS_OUT),
            instance: format!("{instance:016x}"),
            lease_seq: AtomicU64::new(0),
            breaker: Breaker::new(),
            deny: DenyCache::new(),
            held: Mutex::default(),
            slices: Slices::new(s.fleet_size, instance),
            slices_on: s.slices,
            last_decided_us: AtomicU64::new(0),
            queue_script: queue::QueueScript::new(),
            job_script: jobs::JobScript::new(),
            waiters: Mutex::default(),
            watching_run_id: AtomicBool::new(false),
            lanes: thread_local::ThreadLocal::new(),
            holds: Default::default(),
        })
    }

    fn holds(&self) -> &crate::hold::Holds {
        self.holds.get_or_init(Default::default)
    }

    /// True while the circuit breaker is closed (the status page's "breaker" field).
    pub fn breaker_closed(&self) -> bool {
        self.breaker.closed()
    }

    /// Redis's clock (µs) when it last decided an `admit` for this instance; 0 before any.
    pub fn last_decided_us(&self) -> u64 {
        self.last_decided_us.load(Ordering::Relaxed)
    }

    fn next_lease_id(&self) -> String {
        let mut n = itoa::Buffer::new();
        let n = n.format(self.lease_seq.fetch_add(1, Ordering::Relaxed));
        let mut id = String::with_capacity(self.instance.len() + 1 + n.len());
        id.push_str(&self.instance);
        id.push(':');
        id.push_str(n);
        id
    }

    /// One `admit` call for `req`, asking `ask` of its slices.
    async fn try_admit(
        self: &Arc<Self>,
        req: &AdmitRequest,
        ask: Ask,
    ) -> Result<(Decided, Seen), StoreError> {
        self.try_admit_as(req, ask, self.next_lease_id()).await
    }

    /// One `admit` call for `req` under admission id `lease_id`.
    async fn try_admit_as(
        self: &Arc<Self>,
        req: &AdmitRequest,
        ask: Ask,
        lease_id: String,
    ) -> Result<(Decided, Seen), StoreError> {
        self.try_admit_leasing(req, ask, lease_id, self.lease_ttl)
            .await
    }

    /// One `admit` call whose key lease (a plan's `max_in_flight_per_key`), if it takes
    /// one, lasts `lease_ttl` (a job's lasts while it may wait: its `result_ttl`).
    async fn try_admit_leasing(
        self: &Arc<Self>,
        req: &AdmitRequest,
        ask: Ask,
        lease_id: String,
        lease_ttl: Duration,
    ) -> Result<(Decided, Seen), StoreError> {
        // A capped route's slot is taken in its fair queue, after this call (`queue`, in the
        // route's own slot, on one node as on Cluster).
        let capped = req.route_cap.is_some();
        let call = admit_call(req, ask, lease_id, lease_ttl);
        let asked = Instant::now();
        let (r, call) = self.call_admit(call).await?;
        let reply = script::parse_admit(&r, 1 + req.also.len())
            .ok_or_else(|| StoreError::Reply(format!("{r:?}")))?;
        self.last_decided_us
            .store(reply.seen.now_us, Ordering::Relaxed);
        let standing = Standing {
            remaining: reply.remaining,
            reset_us: reply.reset_us,
            each: reply.each,
        };
        let outcome = |verdict| Outcome {
            verdict,
            state: None,
            remaining: reply.remaining,
            reset_us: reply.reset_us,
            each: reply.each,
        };
        if reply.code == AdmitCode::Admitted
            && self.over_key_cap_after_loss(req, &call, asked).await
        {
            // Given back: refused as it would have been, asked after the others' leases.
            let standing = standing.given_back(req.limits(), req.cost);
            return Ok((Decided::KeyBusy(standing), reply.seen));
        }
        let decided = match reply.code {
            AdmitCode::OverBudget => Decided::OverBudget(outcome(Verdict::Reject {
                retry_after_us: reply.a,
            })),
            AdmitCode::KeyBusy => Decided::KeyBusy(standing),
            // Only a call given up on (and undone) meets its tombstone; never its request.
            AdmitCode::Undone => return Err(StoreError::Reply("admission undone".into())),
            AdmitCode::RouteBusy => Decided::RouteBusy(standing),
            AdmitCode::Admitted if capped => {
                self.deny.forget(&req.key);
                Decided::KeyAdmitted(
                    outcome(Verdict::Admit { delay_us: reply.a }),
                    call.slot_keys(),
                    call.lease_id,
                )
            }
            AdmitCode::Admitted => {
                let held = call.slot_keys();
                let lease = if held.is_empty() {
                    Lease::shared(None)
                } else {
                    Lease::shared(Some(RedisLease::hold(self, held, None, call.lease_id)))
                };
                Decided::Admitted(outcome(Verdict::Admit { delay_us: reply.a }), lease)
            }
        };
        Ok((decided, reply.seen))
    }
}

/// The `admit` call for `req` under admission id `lease_id`, asking `ask` of its slices; its
/// key lease, if it takes one, lasts `lease_ttl`.
fn admit_call(req: &AdmitRequest, ask: Ask, lease_id: String, lease_ttl: Duration) -> AdmitCall {
    let key_slots = req.key_cap.is_some();
    let (budget, holds) = keys::budget_and_holds_keys(&req.key);
    let call = AdmitCall {
        budget,
        key_slots: key_slots.then(|| keys::key_slots_key(&req.key)),
        limit: req.limit,
        cost: req.cost,
        key_cap: req.key_cap.unwrap_or(0),
        record: String::new(),
        // A capped route's charge may wait (held for its turn, then queued): its record lives as long as the
        // request may wait and `ADMISSION_RECORD` more, whatever the budgets, written with the
        // charge (the two are lost together or not at all), so that its refund and its charge
        // made again can tell a charge Redis lost with its data (`queue::record`).
        record_ms: match req.route_cap {
            Some(_) => -(script::record_kept_for(req.may_wait()).as_millis() as i64),
            None => script::ADMISSION_RECORD.as_millis() as i64,
        },
        // Every call's admission id; the id of its leases too, if it takes any.
        lease_id,
        lease_ttl_us: lease_ttl.as_micros() as u64,
        also: also_keys(req).collect(),
        holds,
        slice: ask.slice,
        grant: ask.grant,
        hold_ttl_us: slices::HOLD_TTL.as_micros() as u64,
        settle: ask.settle,
        unspent: ask.unspent,
        if_lost: slices::if_lost(&ask.settled, req.limits(), Instant::now()),
    };
    AdmitCall {
        record: keys::admission_key(&req.key, &call.lease_id),
        ..call
    }
}

/// Every budget of `req` with its Redis key, the key's first one first.
pub(super) fn budget_keys(req: &AdmitRequest) -> Vec<(String, Limit)> {
    std::iter::once((keys::budget_key(&req.key), req.limit))
        .chain(also_keys(req))
        .collect()
}

/// `req`'s budgets after the key's first, with their Redis keys.
fn also_keys(req: &AdmitRequest) -> impl Iterator<Item = (String, Limit)> + '_ {
    req.also.iter().map(|e| {
        let key = match &e.bucket {
            Bucket::Key(name) => keys::named_budget_key(&req.key, name),
            Bucket::Route(label) => keys::shared_budget_key(label),
        };
        (key, e.limit)
    })
}
