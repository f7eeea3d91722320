//! One value per operation of the store's scripts: its fields are the operation's arguments,
//! and [`Op::args`] lays them out as the script's KEYS and ARGV (the contract above each
//! script in `lua/store/`). Every number goes as an integer.

use redis::ToRedisArgs;

use super::{AdmitCall, Call, Lua, Op, TOMBSTONE};
use crate::budget::Limit;
use crate::store::redis::slices::{self, IfLost};

/// Where `admit`'s KEYS and ARGV are laid: its own invocation, or the lists of one call of
/// a batch (which says how many of each it has).
pub(super) trait Lay {
    fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self;
    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self;
}

impl Lay for Call<'static> {
    fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        Call::key(self, key)
    }
    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        Call::arg(self, arg)
    }
}

/// How many KEYS and ARGV a call lays: what a batch says of each call before laying it.
#[derive(Default)]
struct Count {
    keys: usize,
    argv: usize,
}

impl Lay for Count {
    fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys += key.num_of_args();
        self
    }
    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.argv += arg.num_of_args();
        self
    }
}

/// The five ARGV of a budget that `admit` decides on: per_unit, rate, capacity, max_delay,
/// and the floor a slice must leave (0 without a slice).
fn decided_budget(inv: &mut impl Lay, l: &Limit, slice: u64) {
    let floor = if slice > 0 { slices::floor(l) } else { 0 };
    inv.arg(l.per_unit)
        .arg(l.rate)
        .arg(l.capacity)
        .arg(l.max_delay)
        .arg(floor);
}

impl AdmitCall {
    /// `admit`'s KEYS and ARGV. A capped route's slot is not taken here but in its fair
    /// queue: no route lease set (the budget key again, never touched) and no route cap.
    fn admit_args(&self, inv: &mut impl Lay) {
        let (route_set, route_cap) = (&self.budget, 0);
        inv.key(&self.budget)
            .key(self.key_slots.as_ref().unwrap_or(&self.budget))
            .key(route_set)
            .key(&self.holds);
        decided_budget(inv, &self.limit, self.slice);
        inv.arg(self.cost)
            .arg(self.key_cap)
            .arg(route_cap)
            .arg(&self.lease_id)
            .arg(self.lease_ttl_us)
            .arg(self.slice)
            .arg(self.unspent)
            .arg(slices::hold_field(self.settle))
            .arg(slices::hold_field(self.grant))
            .arg(self.hold_ttl_us);
        for (key, l) in &self.also {
            inv.key(key);
            decided_budget(inv, l, self.slice);
        }
        inv.arg(self.if_lost.units)
            .arg(self.if_lost.granted_us)
            .arg(self.record_ms)
            .key(&self.record);
    }
}

/// `admit` of the whole request: its budgets and its key's slot.
impl Op for AdmitCall {
    type Reply = super::Packed;
    const SCRIPT: Lua = Lua::Admit;

    fn args(&self, inv: &mut Call<'static>) {
        self.admit_args(inv);
    }

    /// The common decision — one budget, no key cap, no slice asked, no hold settled — goes
    /// to `admit_one`, the same contract without `admit`'s general machinery (less Redis
    /// CPU per call: `bench/script_cpu.sh`).
    fn invocation(&self) -> Call<'static> {
        self.invocation_for(self.script())
    }
}

impl AdmitCall {
    /// The script this call goes to: `admit_one` for what it decides exactly as `admit`
    /// does ([`AdmitCall::is_common`]), else `admit`.
    fn script(&self) -> Lua {
        if self.is_common() {
            Lua::AdmitOne
        } else {
            Lua::Admit
        }
    }

    /// The call to `script` (`admit_one` or `admit`; a test sends a common call to both).
    pub(in crate::store::redis) fn invocation_for(&self, script: Lua) -> Call<'static> {
        let mut inv = Call::new(&super::SCRIPTS[script as usize]);
        self.lay_for(script, &mut inv);
        inv
    }

    /// This call's KEYS and ARGV for `script`.
    fn lay_for(&self, script: Lua, inv: &mut impl Lay) {
        if script == Lua::AdmitOne {
            self.admit_one_args(inv);
        } else {
            self.admit_args(inv);
        }
    }

    /// `admit_one`'s KEYS and ARGV: only what its decision reads (9 values, where `admit`
    /// takes 23) — a batch of them is that much less to send, parse and copy in Redis.
    fn admit_one_args(&self, inv: &mut impl Lay) {
        let l = &self.limit;
        inv.key(&self.budget).key(&self.holds).key(&self.record);
        inv.arg(l.per_unit)
            .arg(l.rate)
            .arg(l.capacity)
            .arg(l.max_delay)
            .arg(self.cost)
            .arg(self.record_ms);
    }

    /// What `admit_one` decides exactly as `admit` does.
    pub(in crate::store::redis) fn is_common(&self) -> bool {
        self.also.is_empty()
            && self.key_slots.is_none()
            && self.key_cap == 0
            && self.slice == 0
            && self.settle == 0
            && self.unspent == 0
            && self.if_lost.units == 0
    }
}

/// `admit_batch`: the calls, decided in one script call in this order, each exactly as if it
/// had been sent alone (group commit, `super::super::batch`). Reply: each call's reply, or
/// `[-1]` for one that failed (it wrote nothing).
pub(in crate::store::redis) struct AdmitBatch<'a>(pub &'a [AdmitCall]);

impl Op for AdmitBatch<'_> {
    type Reply = super::Packed;
    const SCRIPT: Lua = Lua::AdmitBatch;

    fn args(&self, inv: &mut Call<'static>) {
        inv.arg(self.0.len());
        for c in self.0 {
            // Counted first, then laid straight into the call (its KEYS and its ARGV are two
            // lists: each call's keys follow the last call's, and so do its arguments).
            let script = c.script();
            let mut n = Count::default();
            c.lay_for(script, &mut n);
            let which = if script == Lua::AdmitOne { 1 } else { 2 };
            inv.arg(which).arg(n.keys).arg(n.argv);
            c.lay_for(script, inv);
        }
    }
}

/// `undo`: gives back what an admission took — its charge to every budget and its key's
/// lease — if Redis admitted it, once; and makes sure it never will (a call delivered late
/// finds the tombstone and writes nothing). Idempotent: safe to send again. Reply 1 (it had
/// charged: undone) or 0 (it had not, or was undone already).
pub(in crate::store::redis) struct Undo<'a>(pub &'a AdmitCall);

impl Op for Undo<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Undo;

    fn args(&self, inv: &mut Call<'static>) {
        let c = self.0;
        inv.key(&c.record)
            .key(c.key_slots.as_ref().unwrap_or(&c.record))
            .arg(&c.lease_id)
            .arg(TOMBSTONE.as_millis() as u64);
        let budgets =
            std::iter::once((&c.budget, &c.limit)).chain(c.also.iter().map(|(k, l)| (k, l)));
        for (key, l) in budgets {
            inv.key(key).arg(l.per_unit).arg(l.rate).arg(c.cost);
        }
    }
}

/// Each budget with per_unit, rate and `cost` (`refund`, `debit`).
fn budgets_with_cost(inv: &mut Call<'static>, budgets: &[(String, Limit)], cost: u64) {
    for (key, l) in budgets {
        inv.key(key).arg(l.per_unit).arg(l.rate).arg(cost);
    }
}

/// `refund`: gives `cost` units back to each budget (never below empty). Reply: each budget's
/// level afterwards.
pub(in crate::store::redis) struct Refund<'a> {
    pub budgets: &'a [(String, Limit)],
    pub cost: u64,
    /// A key in the budgets' slot that makes the refund once (`refund.lua`): a resend of a
    /// call that timed out is then safe.
    pub once: Option<&'a str>,
    /// With `once`: the charge's admission record and until when (Redis time, µs) it surely
    /// lives (`queue::record::kept_until`). Before then, the refund is made only if it is there:
    /// missing, Redis lost the charge with its data.
    pub record: Option<(&'a str, u64)>,
}

impl Op for Refund<'_> {
    /// Each budget's level once the units are back (ticks), in order.
    type Reply = Vec<i64>;
    const SCRIPT: Lua = Lua::Refund;

    fn args(&self, inv: &mut Call<'static>) {
        budgets_with_cost(inv, self.budgets, self.cost);
        if let Some(marker) = self.once {
            // As long as the refund may be sent again, and a minute more.
            let lasts = super::super::REFUND_RETRY_AT_MOST + std::time::Duration::from_secs(60);
            inv.key(marker).arg(lasts.as_millis() as u64);
            if let Some((record, until_us)) = self.record {
                inv.key(record).arg(until_us);
            }
        }
    }
}

/// `debit`: charges `cost` units that were admitted elsewhere (by the fallback while Redis
/// was unreachable) to each budget, past capacity if need be: the key is then in debt and
/// waits it out. Once per `id` (0: no id). Reply 1.
pub(in crate::store::redis) struct Debit<'a> {
    pub budgets: &'a [(String, Limit)],
    pub cost: u64,
    pub id: u64,
    /// Published as a give-back is (`lua/store/debit.lua`): a write-back of the fallback's.
    pub tell: bool,
}

impl Op for Debit<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Debit;

    fn args(&self, inv: &mut Call<'static>) {
        budgets_with_cost(inv, self.budgets, self.cost);
        inv.arg(self.id);
        if self.tell {
            inv.arg(1);
        }
    }
}

/// `debit` of a queued request's charge again when Redis lost it with its data (its
/// admission record is gone), before the request waits again: the charge, then the record
/// for `record_ms`, so that it is made once. Nothing if the record is there (the charge
/// stands, or was undone), if its refund was made (`marker`), or from `until_us` (Redis time,
/// µs) on, when a missing record may have lapsed. Reply 1.
pub(in crate::store::redis) struct Recharge<'a> {
    pub budgets: &'a [(String, Limit)],
    pub cost: u64,
    pub record: &'a str,
    pub marker: &'a str,
    pub record_ms: u64,
    pub until_us: u64,
}

impl Op for Recharge<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Debit;

    fn args(&self, inv: &mut Call<'static>) {
        budgets_with_cost(inv, self.budgets, self.cost);
        inv.key(self.record)
            .key(self.marker)
            .arg(0)
            .arg(self.record_ms)
            .arg(self.until_us);
    }
}

/// The key's holds, then each budget with per_unit and rate (`settle`, `unspend`, `peek`).
fn holds_and_budgets(inv: &mut Call<'static>, holds: &str, budgets: &[(String, Limit)]) {
    inv.key(holds);
    for (key, l) in budgets {
        inv.key(key).arg(l.per_unit).arg(l.rate);
    }
}

/// `settle`: hands hold `id` (its field, `slices::hold_field`) of the key's slices back with
/// `unspent` units not spent, charging the rest (and any expired hold) to each of its
/// budgets. Idempotent: a hold that is gone is not settled again, so it is safe to send
/// again. A hold Redis lost with its data since `if_lost.granted_us` (its TIME at the grant)
/// is charged what was spent of its `if_lost.units`, once. Reply 1.
pub(in crate::store::redis) struct Settle<'a> {
    pub holds: &'a str,
    pub budgets: &'a [(String, Limit)],
    pub id: &'a str,
    pub unspent: u64,
    pub if_lost: IfLost,
}

impl Op for Settle<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Settle;

    fn args(&self, inv: &mut Call<'static>) {
        inv.arg(self.id).arg(self.unspent);
        holds_and_budgets(inv, self.holds, self.budgets);
        inv.arg(self.if_lost.units).arg(self.if_lost.granted_us);
    }
}

/// `unspend`: refunds `cost` units of a request spent from hold `id`: out of the hold if it
/// is not settled yet (its settling then charges them no more), else to each budget. Reply 1.
pub(in crate::store::redis) struct Unspend<'a> {
    pub holds: &'a str,
    pub budgets: &'a [(String, Limit)],
    pub id: &'a str,
    pub cost: u64,
}

impl Op for Unspend<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Unspend;

    fn args(&self, inv: &mut Call<'static>) {
        inv.arg(self.id).arg(self.cost);
        holds_and_budgets(inv, self.holds, self.budgets);
    }
}

/// `peek`: the levels of a key's budgets now, the slices held of them included, in one
/// atomic view, writing nothing. Reply: each budget's level in ticks.
pub(in crate::store::redis) struct Peek<'a> {
    pub holds: &'a str,
    pub budgets: &'a [(String, Limit)],
}

impl Op for Peek<'_> {
    type Reply = Vec<i64>;
    const SCRIPT: Lua = Lua::Peek;

    fn args(&self, inv: &mut Call<'static>) {
        holds_and_budgets(inv, self.holds, self.budgets);
    }
}

/// `lease`: renews lease `id` in every set for `ttl_us` (re-creating it where it is
/// missing), or releases it when `ttl_us` is 0. Idempotent, so safe to send again. Reply 1.
pub(in crate::store::redis) struct Lease<'a> {
    pub sets: &'a [String],
    pub id: &'a str,
    pub ttl_us: u64,
}

impl Op for Lease<'_> {
    type Reply = i64;
    const SCRIPT: Lua = Lua::Lease;

    fn args(&self, inv: &mut Call<'static>) {
        for set in self.sets {
            inv.key(set);
        }
        inv.arg(self.id).arg(self.ttl_us);
    }
}
