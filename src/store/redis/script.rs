//! Every call of `lua/store.lua`, with its contract: the script is one file, the operation
//! its first argument, so that one `EVALSHA` (reloaded on NOSCRIPT by redis-rs) serves all.
//! Times are Redis `TIME` in µs; levels are ticks (`per_unit` per unit of cost, drained at
//! `rate` per µs), as in `crate::budget`.

use std::time::Duration;

use redis::{FromRedisValue, RedisError, RetryMethod, Script, ScriptInvocation};

use super::conn::Conn;
use super::slices::{self, HoldId, IfLost, Seen};
use crate::budget::{Figure, Figures, Limit, MAX_BUDGETS};

/// Runs one script call (EVALSHA, and on NOSCRIPT — a restarted node, a promoted replica —
/// SCRIPT LOAD and EVALSHA again, by redis-rs), resending it only when the answer proves it
/// did not run: MOVED or READONLY (Redis checks the slot and the role before running a
/// script; the cluster client re-reads its slot map on either). Never after a timeout or a
/// dropped connection: the script may have run, and it may charge. An ASK (a slot being
/// migrated right now) is not followed: it is an error, and `store.on_error` decides.
pub(super) async fn invoke<T: FromRedisValue>(
    inv: &ScriptInvocation<'_>,
    conn: &mut Conn,
) -> Result<T, RedisError> {
    const RESENDS: usize = 2;
    let mut resent = 0;
    loop {
        match inv.invoke_async::<T>(conn).await {
            Err(e) if resent < RESENDS && stale_topology(&e) => {
                resent += 1;
                // Let the slot map refresh that the error started go first.
                tokio::time::sleep(Duration::from_millis(resent as u64)).await;
            }
            r => return r,
        }
    }
}

/// Redis answered with an error, so the script wrote nothing: it refused to run it (the
/// slot is elsewhere or moving: MOVED, ASK, TRYAGAIN; the cluster or the primary is down:
/// CLUSTERDOWN, MASTERDOWN; loading; a replica now: READONLY; out of memory under
/// `noeviction`: OOM — `lua/store.lua` is a flagged script, so Redis checks its role and
/// memory before running it), or the script stopped with an error at one of its checks,
/// which every operation makes before its first write. Anything but a reply (a broken
/// connection, a timeout) is not this.
pub(crate) fn refused_before_running(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    )
}

/// MOVED or READONLY: sent to a node that does not own the key (any more), so not run.
fn stale_topology(e: &RedisError) -> bool {
    matches!(
        e.retry_method(),
        RetryMethod::MovedRedirect | RetryMethod::RefreshSlotsAndRetry
    )
}

/// The reply codes of `admit` (the Lua constants of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AdmitCode {
    /// Nothing written; the reply's second figure is the retry-after in µs.
    OverBudget = 0,
    /// The key's lease set is full; nothing written.
    KeyBusy = 1,
    /// The route's lease set is full; nothing written.
    RouteBusy = 2,
    /// Charged and leased; the second figure is the delay in µs before forwarding.
    Admitted = 3,
    /// The call's admission id was given up and undone before it arrived: nothing written.
    Undone = 4,
}

impl AdmitCode {
    const ALL: [AdmitCode; 5] = [
        AdmitCode::OverBudget,
        AdmitCode::KeyBusy,
        AdmitCode::RouteBusy,
        AdmitCode::Admitted,
        AdmitCode::Undone,
    ];

    pub(super) fn from_reply(code: i64) -> Option<AdmitCode> {
        Self::ALL.into_iter().find(|c| *c as i64 == code)
    }
}

/// The arguments of one `admit` call, owned so that the call can outlive its request.
#[derive(Debug, Clone)]
pub(super) struct AdmitCall {
    pub budget: String,
    pub key_slots: Option<String>,
    pub route_slots: Option<String>,
    pub limit: Limit,
    pub cost: u64,
    pub key_cap: u32,
    pub route_cap: u32,
    /// The call's admission id (unique across the fleet), also the id of the leases it takes.
    pub lease_id: String,
    /// Where Redis records the admission by its id (`keys::admission_key`, the key's slot).
    pub record: String,
    pub lease_ttl_us: u64,
    /// Further budgets (their keys and limits), charged with the first or not at all.
    pub also: Vec<(String, Limit)>,
    /// The key's budget slices held in Redis (`super::slices`).
    pub holds: String,
    /// Extra units asked for a budget slice (0: none), to be held as `grant` for
    /// `hold_ttl_us`.
    pub slice: u64,
    pub grant: HoldId,
    pub hold_ttl_us: u64,
    /// The hold this call settles first (0: none), with its units not spent, and what to
    /// charge of it if Redis lost it.
    pub settle: HoldId,
    pub unspent: u64,
    pub if_lost: IfLost,
}

impl AdmitCall {
    /// The lease sets this call takes a slot in.
    pub fn slot_keys(&self) -> Vec<String> {
        self.key_slots
            .iter()
            .chain(&self.route_slots)
            .cloned()
            .collect()
    }
}

/// An `admit` reply taken apart: code, `a` (retry-after or delay, µs), the decisive budget's
/// remaining and reset_us, every budget's figures when there are several, and what it says
/// of the slice, the levels and the holds. `budgets` is how many the call was made on. `None`
/// if malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AdmitReply {
    pub code: AdmitCode,
    pub a: u64,
    pub remaining: u64,
    pub reset_us: u64,
    pub each: Figures,
    pub seen: Seen,
}

pub(super) fn parse_admit(r: &[i64], budgets: usize) -> Option<AdmitReply> {
    let [code, a, remaining, reset_us, granted, now_us, ref rest @ ..] = r[..] else {
        return None;
    };
    if budgets == 0 || budgets > MAX_BUDGETS || rest.len() < 2 * budgets {
        return None;
    }
    let (levels, rest) = rest.split_at(budgets);
    let (held, more) = rest.split_at(budgets);
    let mut seen = Seen {
        granted: granted.max(0) as u64,
        now_us: now_us.max(0) as u64,
        ..Seen::default()
    };
    for (slot, l) in seen.levels.iter_mut().zip(levels) {
        *slot = (*l).max(0) as u64;
    }
    for (slot, h) in seen.held.iter_mut().zip(held) {
        *slot = (*h).max(0) as u64;
    }
    Some(AdmitReply {
        code: AdmitCode::from_reply(code)?,
        a: a.max(0) as u64,
        remaining: remaining.max(0) as u64,
        reset_us: reset_us.max(0) as u64,
        each: figures(more)?,
        seen,
    })
}

/// The rest of an `admit` reply with several budgets: the decisive one's index, then each
/// one's remaining and reset_us. Empty for one budget.
fn figures(more: &[i64]) -> Option<Figures> {
    let mut each = Figures::default();
    let Some((&decisive, pairs)) = more.split_first() else {
        return Some(each);
    };
    if pairs.len() % 2 != 0 || pairs.len() / 2 > MAX_BUDGETS {
        return None;
    }
    each.decisive = u8::try_from(decisive).ok()?;
    for p in pairs.chunks_exact(2) {
        each.push(Figure {
            remaining: p[0].max(0) as u64,
            reset_us: p[1].max(0) as u64,
        });
    }
    Some(each)
}

/// How long Redis keeps an admission's record: beyond the longest time the gateway keeps
/// sending the `undo` of a call it gave up on ([`UNDO_FOR`]).
pub(super) const ADMISSION_RECORD: Duration = Duration::from_secs(120);
/// How long an undone id's tombstone keeps a late delivery of its call from charging: past
/// the time a kernel keeps retransmitting a closed connection's unsent data (~15 min).
pub(super) const TOMBSTONE: Duration = Duration::from_secs(20 * 60);
/// How long the gateway keeps sending the `undo` of a call it gave up on.
pub(super) const UNDO_FOR: Duration = Duration::from_secs(100);

pub(super) struct StoreScript(Script);

impl StoreScript {
    pub fn new() -> Self {
        StoreScript(Script::new(include_str!("../lua/store.lua")))
    }

    /// `admit`: decides one request and, when it passes, charges it and takes its slots.
    ///
    /// KEYS[1] budget, KEYS[2] key lease set, KEYS[3] route lease set (an unused set is passed
    /// as the budget key: the script never touches it), KEYS[4] the key's holds, KEYS[5..]
    /// further budgets.
    /// ARGV[2] per_unit, ARGV[3] rate, ARGV[4] capacity, ARGV[5] max_delay (ticks), ARGV[6]
    /// floor (units a slice must leave), ARGV[7] cost, ARGV[8] key_cap, ARGV[9] route_cap
    /// (0 = none), ARGV[10] lease id, ARGV[11] lease_ttl (µs), ARGV[12] slice (extra units
    /// wanted), ARGV[13] unspent (of the hold settled), ARGV[14] the hold settled first (''
    /// none), ARGV[15] the new hold's id, ARGV[16] its life (µs); from ARGV[17], per_unit,
    /// rate, capacity, max_delay, floor of each further budget.
    /// Reply `{code, a, remaining, reset_us, granted, now_us, level of each budget..., held
    /// ticks of each budget...}` with code an [`AdmitCode`], then, with further budgets, the
    /// decisive budget's index and `remaining, reset_us` of each (see [`parse_admit`]). Writes
    /// only when admitted (to every budget), and the settling always. Charges: never retry
    /// it after a timeout.
    pub fn admit<'a>(&'a self, c: &'a AdmitCall) -> ScriptInvocation<'a> {
        self.admit_with(c, c.route_slots.as_ref().unwrap_or(&c.budget), c.route_cap)
    }

    /// `admit` with the route's lease set and cap given (the key's side alone: the budget key
    /// again, and cap 0).
    fn admit_with<'a>(
        &'a self,
        c: &'a AdmitCall,
        route_set: &'a str,
        route_cap: u32,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        let floor = |l: &Limit| if c.slice > 0 { slices::floor(l) } else { 0 };
        let l = &c.limit;
        inv.key(&c.budget)
            .key(c.key_slots.as_ref().unwrap_or(&c.budget))
            .key(route_set)
            .arg("admit")
            .arg(l.per_unit)
            .arg(l.rate)
            .arg(l.capacity)
            .arg(l.max_delay)
            .arg(floor(l))
            .arg(c.cost)
            .arg(c.key_cap)
            .arg(route_cap)
            .arg(&c.lease_id)
            .arg(c.lease_ttl_us)
            .arg(c.slice)
            .arg(c.unspent)
            .arg(slices::hold_field(c.settle))
            .arg(slices::hold_field(c.grant))
            .arg(c.hold_ttl_us);
        inv.key(&c.holds);
        for (key, l) in &c.also {
            inv.key(key)
                .arg(l.per_unit)
                .arg(l.rate)
                .arg(l.capacity)
                .arg(l.max_delay)
                .arg(floor(l));
        }
        inv.arg(c.if_lost.units)
            .arg(c.if_lost.granted_us)
            .arg(ADMISSION_RECORD.as_millis() as u64);
        inv.key(&c.record);
        inv
    }

    /// `undo`: gives back what admission `c` took — its charge to every budget and its key's
    /// lease — if Redis admitted it, once; and makes sure it never will (a call delivered
    /// late finds the tombstone and writes nothing). Idempotent: safe to send again.
    ///
    /// KEYS[1] the record, KEYS[2] the key's lease set (the record again: none), KEYS[3..]
    /// budgets; ARGV[2] lease id, ARGV[3] tombstone life (ms), then per_unit, rate, cost of
    /// each budget. Reply 1 (it had charged: undone) or 0 (it had not, or undone already).
    pub fn undo<'a>(&'a self, c: &'a AdmitCall) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        inv.key(&c.record)
            .key(c.key_slots.as_ref().unwrap_or(&c.record))
            .arg("undo")
            .arg(&c.lease_id)
            .arg(TOMBSTONE.as_millis() as u64);
        for (key, l) in
            std::iter::once((&c.budget, &c.limit)).chain(c.also.iter().map(|(k, l)| (k, l)))
        {
            inv.key(key).arg(l.per_unit).arg(l.rate).arg(c.cost);
        }
        inv
    }

    /// Every budget of the call, the first one first (for a refund of all of them).
    pub fn budgets_of(c: &AdmitCall) -> Vec<(String, Limit)> {
        std::iter::once((c.budget.clone(), c.limit))
            .chain(c.also.iter().cloned())
            .collect()
    }

    /// `admit` for the key's side only (its budget and lease set, one hash slot), as Redis
    /// Cluster needs on a capped route; the route's slot is then taken by [`Self::take`].
    pub fn admit_key<'a>(&'a self, c: &'a AdmitCall) -> ScriptInvocation<'a> {
        self.admit_with(c, &c.budget, 0)
    }

    /// `take`: a slot in a route's lease set for lease `id`, if one is free.
    ///
    /// KEYS[1] route lease set; ARGV[2] route_cap, ARGV[3] lease id, ARGV[4] lease_ttl (µs).
    /// Reply [`AdmitCode::Admitted`] (taken) or [`AdmitCode::RouteBusy`] (nothing written).
    pub fn take<'a>(&'a self, set: &'a str, c: &'a AdmitCall) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        inv.key(set)
            .arg("take")
            .arg(c.route_cap)
            .arg(&c.lease_id)
            .arg(c.lease_ttl_us);
        inv
    }

    /// `refund`: gives `cost` units back to each budget (never below empty).
    ///
    /// KEYS[i] budget; ARGV per_unit, rate, cost of each from ARGV[2]. Reply 1.
    pub fn refund<'a>(&'a self, budgets: &'a [(String, Limit)], cost: u64) -> ScriptInvocation<'a> {
        self.adjust("refund", budgets, cost)
    }

    /// `debit`: charges `cost` units that were admitted elsewhere (by the fallback while Redis
    /// was unreachable) to each budget, past capacity if need be: the key is then in debt and
    /// waits it out.
    ///
    /// KEYS[i] budget; ARGV per_unit, rate, cost of each from ARGV[2]. Reply 1.
    pub fn debit<'a>(
        &'a self,
        budgets: &'a [(String, Limit)],
        cost: u64,
        id: u64,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.adjust("debit", budgets, cost);
        inv.arg(id);
        inv
    }

    fn adjust<'a>(
        &'a self,
        op: &str,
        budgets: &'a [(String, Limit)],
        cost: u64,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        inv.arg(op);
        for (key, l) in budgets {
            inv.key(key).arg(l.per_unit).arg(l.rate).arg(cost);
        }
        inv
    }

    /// `settle`: hands hold `id` of the key's slices back with `unspent` units not spent,
    /// charging the rest (and any expired hold) to each of its budgets. Idempotent: a hold
    /// that is gone is not settled again, so it is safe to send again.
    ///
    /// A hold Redis lost with its data (restarted empty) since `lost.granted_us` (its TIME
    /// at the grant) is charged what was spent of its `lost.units`, once.
    ///
    /// KEYS[1] the key's holds, KEYS[2..] its budgets; ARGV[2] id, ARGV[3] unspent, then
    /// per_unit, rate of each budget, then units, granted_us. Reply 1.
    pub fn settle<'a>(
        &'a self,
        holds: &str,
        budgets: &[(String, Limit)],
        id: &str,
        unspent: u64,
        lost: IfLost,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.on_hold("settle", holds, budgets, id, unspent);
        inv.arg(lost.units).arg(lost.granted_us);
        inv
    }

    /// `unspend`: refunds `cost` units of a request spent from hold `id`: out of the hold if
    /// it is not settled yet (its settling then charges them no more), else to each budget.
    ///
    /// KEYS[1] the key's holds, KEYS[2..] its budgets; ARGV[2] id, ARGV[3] cost, then
    /// per_unit, rate of each budget. Reply 1.
    pub fn unspend<'a>(
        &'a self,
        holds: &'a str,
        budgets: &'a [(String, Limit)],
        id: &'a str,
        cost: u64,
    ) -> ScriptInvocation<'a> {
        self.on_hold("unspend", holds, budgets, id, cost)
    }

    fn on_hold<'a>(
        &'a self,
        op: &str,
        holds: &str,
        budgets: &[(String, Limit)],
        id: &str,
        units: u64,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        inv.key(holds).arg(op).arg(id).arg(units);
        for (key, l) in budgets {
            inv.key(key).arg(l.per_unit).arg(l.rate);
        }
        inv
    }

    /// `peek`: the levels of a key's budgets now, the slices held of them included, in one
    /// atomic view, writing nothing.
    ///
    /// KEYS[1] the key's holds, KEYS[2..] its budgets; ARGV[2] '', ARGV[3] 0, then per_unit,
    /// rate of each budget. Reply: each budget's level in ticks.
    pub fn peek<'a>(
        &'a self,
        holds: &'a str,
        budgets: &'a [(String, Limit)],
    ) -> ScriptInvocation<'a> {
        self.on_hold("peek", holds, budgets, "", 0)
    }

    /// `lease`: renews lease `id` in every set for `ttl_us` (re-creating it where it is missing), or releases it
    /// when `ttl_us` is 0. Idempotent, so safe to send again.
    ///
    /// KEYS[1..n] lease sets; ARGV[2] lease id, ARGV[3] ttl_us. Reply 1.
    pub fn lease<'a>(
        &'a self,
        keys: impl IntoIterator<Item = &'a String>,
        id: &'a str,
        ttl_us: u64,
    ) -> ScriptInvocation<'a> {
        let mut inv = self.0.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg("lease").arg(id).arg(ttl_us);
        inv
    }
}

#[cfg(test)]
mod tests;
