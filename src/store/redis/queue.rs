//! A capped route's fair queue, fleet-wide, in Redis (`lua/queue.lua`; DESIGN §8).
//!
//! A capped request is charged first (the key's budgets and its in-flight cap, in the key's
//! slot: `admit` without the route), then it *enters* the route (in the route's slot): it
//! takes a slot if one is free and nobody of its key waits, else it waits in the route's queue
//! (or is refused at `max_queue`). A release (or a lapsed lease) hands the slot to the next
//! waiter in the same script call and publishes the waiter's id on its instance's channel:
//! this instance's subscriber wakes it at once. A waiter therefore never polls; each instance
//! with waiters on a route *beats* there every 500 ms (its waiters are alive; grants it might
//! have missed come back in the reply; lapsed leases and dead instances' waiters are cleared
//! then, so a slot granted to a dead waiter goes to the next within about 2 s).
//!
//! Leaving unserved (`queue_timeout`, `max_queue`, the client gone) gives the charge back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Script;

use super::admit::Once;
use super::guard::Guard;
use super::keys::{self, queue_keys, QueueKeys};
use super::script::Call;
use super::{Decided, RedisBackend};
use crate::store::fallback::SharedAnswer;
use crate::store::{lock, Admission, AdmitRequest, Standing, StoreError};
use crate::telemetry::Queued;

mod beat;
mod owed;
mod record;
mod unserved;
mod whole;
pub(in crate::store::redis) use beat::Waiters;
use beat::Wake;
use unserved::{HeldId, PendingId, Unserved};

/// How long an instance counts as alive after its last beat.
pub(super) const ALIVE_FOR: Duration = Duration::from_secs(2);
/// Under `on_error: deny`, how long a waiter keeps its place while its instance's beats on
/// the route fail (from the last one Redis answered): a stall, a restart, a network blip.
/// Within [`ALIVE_FOR`] and the 5 s after which Redis hands a dropped waiter's charge out
/// (`lua/queue.lua`, `OWED_AFTER_US`), less a beat: Redis still keeps its place when its
/// instance is back, whether Redis itself stalled or only this instance was cut off.
pub(super) const DENY_WAITS_OUT: Duration = Duration::from_secs(5);
/// How long a granted slot waits for its instance to confirm it (told by Pub/Sub, or by its
/// next beat 500 ms later, a live instance confirms within milliseconds). One that lets a
/// grant lapse counts as dead until it beats again, so that a dead instance's grants pass on
/// within this plus one beat of the release (DESIGN §8: within 2 s).
pub(super) const GRANT_TTL: Duration = Duration::from_secs(1);

const TAKEN: i64 = 1;
const FULL: i64 = 2;
const QUEUED: i64 = 0;
/// The id was given up on: it left, or was dropped as a dead instance's and its charge given
/// back by another (`lua/queue.lua`, `enter`).
const GIVEN_UP: i64 = 3;
const LEFT: i64 = 0;
const GRANTED: i64 = 1;

/// How long a waiter id given up on is refused by a late `enter`: the resend horizon of an
/// admission's record.
const GIVEN_UP_FOR: Duration = super::script::ADMISSION_RECORD;

/// `lua/queue.lua`.
pub(super) struct QueueScript(Script);

impl QueueScript {
    pub fn new() -> Self {
        QueueScript(Script::new(include_str!("../lua/queue.lua")))
    }

    pub(super) fn call<'a>(&'a self, keys: &QueueKeys, op: &str) -> Call<'a> {
        let mut inv = Call::new(&self.0);
        for k in keys {
            inv.key(k);
        }
        inv.arg(op);
        inv
    }

    fn confirm<'a>(&'a self, keys: &QueueKeys, id: &str, lease_ttl: Duration) -> Call<'a> {
        let mut inv = self.call(keys, "confirm");
        inv.arg(id).arg(lease_ttl.as_micros() as u64);
        inv
    }

    /// Renews lease `id` for `ttl_us`, making it again as `key`'s (the key's tag) if the
    /// route lost it (`lua/queue.lua`, `hold`).
    pub(super) fn hold<'a>(
        &'a self,
        keys: &QueueKeys,
        id: &str,
        key: &str,
        ttl_us: u64,
    ) -> Call<'a> {
        let mut inv = self.call(keys, "hold");
        inv.arg(id).arg(key).arg(ttl_us);
        inv
    }

    pub fn release<'a>(&'a self, keys: &QueueKeys, id: &str) -> Call<'a> {
        let mut inv = self.call(keys, "release");
        inv.arg(id)
            .arg(GRANT_TTL.as_micros() as u64)
            .arg(GIVEN_UP_FOR.as_micros() as u64);
        inv
    }
}

/// The charge of a request waiting in a route's queue, for the instance to give back should
/// it exit first.
#[derive(Debug)]
pub(in crate::store::redis) struct Owed {
    req: AdmitRequest,
    keys: QueueKeys,
    key_slots: Vec<String>,
    /// `Unserved::record_kept`.
    record_kept: u64,
}

/// µs from a charge until every budget it was made in is full again (its figures' latest
/// reset): by then a refund of it gives nothing back.
fn drained_in(o: &crate::budget::Outcome) -> u64 {
    o.each
        .as_slice()
        .iter()
        .map(|f| f.reset_us)
        .fold(o.reset_us, u64::max)
}

pub(super) fn leave<'a>(script: &'a QueueScript, keys: &QueueKeys, id: &str) -> Call<'a> {
    let mut inv = script.call(keys, "leave");
    inv.arg(id).arg(GIVEN_UP_FOR.as_micros() as u64);
    inv
}

impl RedisBackend {
    /// At exit: the requests still waiting in a queue leave it, never to run, and get their
    /// charges back; the calls go into `sends`, beside the releases of the slots held. Every
    /// owed charge is taken at once, first: a request granted a slot from now on finds its
    /// charge gone and does not run (`Unserved::charge_kept`). Past the breaker: this is the
    /// last chance.
    pub(super) fn give_back_owed(self: &Arc<Self>, sends: &mut tokio::task::JoinSet<()>) {
        let owed = std::mem::take(&mut lock(&self.waiters).owed);
        for (id, o) in owed {
            let store = self.clone();
            sends.spawn(async move {
                let past_breaker = Guard::Bypass(super::LATE_REPLY_WAIT);
                store.leave_queue(&o.keys, &id, past_breaker).await;
                store
                    .give_back(&o.req, o.key_slots, id, o.record_kept)
                    .await;
            });
        }
    }

    /// Takes waiter `id` out of its route's queue for good; a slot granted to it as it left
    /// (or an answer not known) is released, so that it goes on to the next waiter (a release
    /// of a lease that is not there does nothing).
    async fn leave_queue(self: &Arc<Self>, keys: &QueueKeys, id: &str, guard: Guard) {
        let inv = leave(&self.queue_script, keys, id);
        let left = self
            .guarded(guard, |mut conn| async move {
                Ok(super::script::invoke::<Vec<i64>>(&inv, &mut conn).await?)
            })
            .await;
        if left.ok().and_then(|v| v.first().copied()) != Some(LEFT) {
            self.release_keys(vec![keys[0].clone()], id.to_string())
                .await;
        }
    }

    /// A charged admission that leaves its route's queue unserved (a request, or a job the
    /// queue refused): its charge back (if Redis still holds it, while its record is kept:
    /// until `kept_us`, Redis time, 0 for none; `Once`), then its key's slot. Each budget's
    /// level once the charge is back, when the refund ran at once.
    pub(super) async fn give_back(
        self: &Arc<Self>,
        req: &AdmitRequest,
        key_slots: Vec<String>,
        id: String,
        kept_us: u64,
    ) -> Option<Vec<i64>> {
        let once = Once::kept(req, &id, kept_us);
        let levels = self
            .undo_charge(super::budget_keys(req), req.cost, Some(once))
            .await;
        self.release_keys(key_slots, id).await;
        levels
    }

    /// A capped request: charged for its key, then into the route's fair queue.
    pub(super) async fn admit_capped(
        self: &Arc<Self>,
        req: &AdmitRequest,
        cap: u32,
    ) -> Result<SharedAnswer, StoreError> {
        let start = Instant::now();
        let asked = start;
        // After Redis lost its data, the wait while the others register their leases again
        // counts against the request's queue_timeout (from `start`): one whose queue_timeout
        // is shorter waits it out, then takes a free slot or is refused at once. (An admitted
        // request's queue time is only its wait for a grant: this wait is the store's.)
        self.after_data_loss(req).await;
        let keys = queue_keys(&keys::route_slots_key(&req.route))
            .ok_or_else(|| StoreError::Reply("route lease key".into()))?;
        let pending = PendingId::new(self, &keys[0]);
        let decided = self.try_admit_as(req, Default::default(), pending.id.clone());
        let (outcome, key_slots, id, seen) = match decided.await? {
            (Decided::KeyAdmitted(o, key_slots, id), seen) => (o, key_slots, id, seen),
            (other, _) => return Ok(self.answer(req, other, start)),
        };
        let record_kept = record::kept_until(req, &seen);
        let delay_us = outcome.delay_us();
        let mut unserved = Unserved {
            store: self.clone(),
            req: Some(req.clone()),
            charge: owed::Charge::of(req, &id, record_kept),
            record_kept,
            keys,
            key_slots,
            id,
            waiting: false,
            // Not before it enters (after its hold, if any).
            in_route: delay_us == 0,
            owed: false,
            waited: Duration::ZERO,
            renew_key: None,
            drains_by: Instant::now() + Duration::from_micros(drained_in(&outcome)),
            _pending: pending,
        };
        unserved.renew_key = self.keep_key_lease(&unserved.key_slots, &unserved.id);
        // Held for its `max_delay` turn before it enters (`crate::hold`): its queue time
        // counts from then.
        let held = match delay_us {
            0 => Duration::ZERO,
            _ => match self.hold_before_queue(req, &outcome, &mut unserved).await? {
                Ok(held) => held,
                Err(refused) => return Ok(refused),
            },
        };
        let start = start + held;
        // Redis seen anew while this request was charged (or held): its thread's connection
        // to the old process looked open, its charge went again on a new one, and that read
        // the new `run_id`. The others register their leases again before it may take a slot.
        if self.conns.run_id.changed_since(asked) {
            self.after_data_loss(req).await;
        }
        let mut again = false;
        loop {
            let reentry = std::mem::replace(&mut again, true);
            if reentry {
                // Back into the queue: if it lost its waiters because Redis lost its data,
                // the leases held elsewhere are registered again before this one may take a
                // slot, as for any admission (`after_data_loss`).
                self.after_data_loss(req).await;
                // Not if the instance is exiting and gave its charge back, nor past its time.
                if !unserved.charge_kept(false) || start.elapsed() >= req.queue_timeout {
                    return Ok(self.route_busy(req, &outcome, unserved, start, false).await);
                }
                // Its charge went with Redis's data, if its record did: made again before it
                // waits again, as the fallback's write-back would have (it runs after all).
                // Only while the record is known to be kept (missing later, it may have
                // lapsed): Redis decides, by its own clock.
                let kept = unserved.record_kept;
                if kept > 0 && self.conns.run_id.changed_since(start) {
                    self.recharge(req, &unserved.id, kept).await?;
                }
            }
            let entered: Vec<i64> = self.call(self.enter(req, cap, &unserved)).await?;
            match entered.first().copied() {
                Some(TAKEN) => break,
                Some(QUEUED) => {
                    if self.wait_granted(req, &mut unserved, start).await? {
                        break;
                    }
                    if start.elapsed() >= req.queue_timeout {
                        return Ok(self.route_busy(req, &outcome, unserved, start, false).await);
                    }
                    // The grant lapsed before this instance confirmed it (it reached us
                    // late): queue again.
                }
                // Dropped as a dead instance's while this one stalled, and its charge given
                // back by another: it does not run (its own refund, by the same marker, gives
                // nothing back twice).
                Some(code @ (FULL | GIVEN_UP)) => {
                    unserved.in_route = false;
                    // Refused as it joined, unless it had waited already (its grant lapsed).
                    let full = code == FULL && !reentry;
                    return Ok(self.route_busy(req, &outcome, unserved, start, full).await);
                }
                _ => return Err(StoreError::Reply(format!("enter: {entered:?}"))),
            }
        }
        if !unserved.charge_kept(true) {
            // Granted as the instance exits, after it gave the charge back: it does not run
            // (the slot is released as it drops).
            return Ok(self.route_busy(req, &outcome, unserved, start, false).await);
        }
        let waited = unserved.waited;
        let lease = unserved.served();
        Ok(SharedAnswer {
            // Held already, before the queue: nothing left to hold.
            admission: Admission::Admitted {
                standing: (&outcome).into(),
                delay_us: 0,
                lease,
                queued: waited,
            },
            reached: true,
        })
    }

    /// Holds a charged request for its `max_delay` turn, before it enters its route's queue:
    /// how long, or the answer when it could not be held (its charge given back). Redis may
    /// have lost its data meanwhile, and the charge with it: made again before it enters, as
    /// for a waiter that enters again.
    async fn hold_before_queue(
        self: &Arc<Self>,
        req: &AdmitRequest,
        o: &crate::budget::Outcome,
        u: &mut Unserved,
    ) -> Result<Result<Duration, SharedAnswer>, StoreError> {
        let holding = Instant::now();
        let held = {
            // Not one this instance enters now: its beats need not cover the route for it.
            let _held = HeldId::new(self, &u.id);
            self.holds().before_queue(o.delay_us()).await
        };
        if let Err(not) = held {
            // An exiting instance waits for held requests: for this one until its charge is
            // back (its permit goes then).
            let standing = self.given_back(req, o, u).await;
            drop(not.permit);
            return Ok(Err(SharedAnswer {
                admission: Admission::NotHeld {
                    standing,
                    hold_us: o.delay_us(),
                    exiting: not.exiting,
                },
                reached: true,
            }));
        }
        let held = holding.elapsed();
        self.after_data_loss(req).await;
        if u.record_kept > 0 && self.conns.run_id.changed_since(holding) {
            self.recharge(req, &u.id, u.record_kept).await?;
        }
        u.in_route = true;
        Ok(Ok(held))
    }

    /// Waits for a queued request's grant (until its `queue_timeout`) and confirms it: `true`
    /// when the request holds its slot, `false` when it left the queue or its grant lapsed.
    async fn wait_granted(
        self: &Arc<Self>,
        req: &AdmitRequest,
        u: &mut Unserved,
        start: Instant,
    ) -> Result<bool, StoreError> {
        let rx = self.wait_for(&u.keys, &u.id);
        u.waiting = true;
        u.owe();
        let _queued = Queued::new(&req.route);
        let left = req.queue_timeout.saturating_sub(start.elapsed());
        let asleep = Instant::now();
        let woken = tokio::time::timeout(left, rx).await;
        u.waited += asleep.elapsed();
        if let Ok(Ok(Wake::Requeue)) = woken {
            u.forget_waiter();
            return Ok(false);
        }
        if woken.is_err() {
            let left = self
                .call::<Vec<i64>>(leave(&self.queue_script, &u.keys, &u.id))
                .await;
            let code = left.as_ref().ok().and_then(|v| v.first().copied());
            if code != Some(GRANTED) {
                // Left unserved: `Unserved` gives the charge back (and, if leaving failed,
                // tries again).
                u.in_route = code != Some(LEFT);
                match left {
                    // Its time ran out while the store did not answer (it waited the store
                    // out, `DENY_WAITS_OUT`): the store's failure, which `deny` answers, not
                    // a full route's.
                    Err(e) if self.waiters_outlast.is_some() => return Err(e),
                    _ => return Ok(false),
                }
            }
        }
        u.forget_waiter();
        // Confirm the slot for a whole lease before its short grant lapses: past an open
        // breaker (the grant is Redis's word that it answers again: a waiter that rode out a
        // stall hears it before its instance's breaker has probed the store).
        let confirm = self.queue_script.confirm(&u.keys, &u.id, self.lease_ttl);
        let confirmed: Vec<i64> = self
            .call_repeatable_guarded(super::guard::Guard::Bypass(GRANT_TTL), confirm)
            .await?;
        Ok(confirmed.first() == Some(&1))
    }

    /// `enter` of this instance's waiter, its charge kept beside it in the queue.
    fn enter(&self, req: &AdmitRequest, cap: u32, u: &Unserved) -> Call<'_> {
        let mut inv = self.enter_as(&u.keys, &u.id, req, cap, &self.instance, ALIVE_FOR);
        inv.arg(owed::refused_for(req).as_micros() as u64)
            .arg(&u.charge);
        inv
    }

    /// `enter` of waiter `id` for `req` on `instance` (this one, or the fleet's jobs), alive
    /// for `alive` after this call.
    pub(super) fn enter_as(
        &self,
        keys: &QueueKeys,
        id: &str,
        req: &AdmitRequest,
        cap: u32,
        instance: &str,
        alive: Duration,
    ) -> Call<'_> {
        let mut inv = self.queue_script.call(keys, "enter");
        inv.arg(id)
            .arg(keys::key_tag(&req.key))
            .arg(req.fair.weight.max(1))
            .arg(cap)
            .arg(req.fair.per_key.unwrap_or(0))
            .arg(req.fair.max_queue.unwrap_or(0))
            .arg(self.lease_ttl.as_micros() as u64)
            .arg(instance)
            .arg(alive.as_micros() as u64)
            .arg(GRANT_TTL.as_micros() as u64)
            .arg(req.fair.since);
        inv
    }

    /// A charged request that leaves unserved: out of the queue (if it entered), its charge
    /// given back, and its budgets' figures as that refund left them (what the key's other
    /// requests have spent since included). Should the refund not answer within
    /// `store.timeout` (it goes on), or the key have budget slices (held units are not in the
    /// refund's levels), the figures as before its charge, given back.
    async fn given_back(
        &self,
        req: &AdmitRequest,
        o: &crate::budget::Outcome,
        unserved: &mut Unserved,
    ) -> Standing {
        let levels = match unserved.leave() {
            Some(rx) if !self.slices_on => tokio::time::timeout(self.timeout, rx)
                .await
                .ok()
                .and_then(Result::ok),
            _ => None,
        };
        levels
            .and_then(|levels| Standing::of_levels(req.limits(), &levels))
            .unwrap_or_else(|| Standing::from(o).given_back(req.limits(), req.cost))
    }

    /// 503 `route-busy` for a charged request that leaves unserved, with its budgets' figures
    /// once its charge is back (`given_back`).
    async fn route_busy(
        &self,
        req: &AdmitRequest,
        o: &crate::budget::Outcome,
        mut unserved: Unserved,
        start: Instant,
        full: bool,
    ) -> SharedAnswer {
        let standing = self.given_back(req, o, &mut unserved).await;
        SharedAnswer {
            // Its wait for a grant; one that timed out waited its queue_timeout (the rest of
            // its time, its calls to Redis, is the store's). `full`: refused as it joined.
            admission: Admission::RouteBusy {
                standing,
                queued: match full {
                    true => unserved.waited,
                    false => (unserved.waited).max(start.elapsed().min(req.queue_timeout)),
                },
                full,
            },
            reached: true,
        }
    }
}
