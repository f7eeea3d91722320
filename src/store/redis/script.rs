//! The store's scripts and how they are called. Each operation on budgets and leases is a
//! script of its own, `lua/store/<op>.lua` after the helpers of `lua/store/common.lua` (and,
//! but for `admit_one`, of `extra.lua`; the admitting scripts also take `pack.lua`, and
//! answer packed: [`Packed`]). Its KEYS/ARGV/reply contract is written above it there. Each
//! call is built by one typed value per operation (`ops`: its fields are the operation's
//! arguments) into a [`Call`], sent as one `EVALSHA` (on NOSCRIPT: `SCRIPT LOAD`, then again:
//! [`invoke`]). Times are Redis `TIME` in µs; levels are ticks (`per_unit` per unit of cost,
//! drained at `rate` per µs), as in `crate::budget`.

use std::time::Duration;

use std::sync::LazyLock;

use redis::{
    Cmd, FromRedisValue, ParsingError, RedisError, RetryMethod, Script, ToRedisArgs, Value,
};

use super::conn::Conn;
use super::slices::{HoldId, IfLost, Seen};
use crate::budget::{Figure, Figures, Limit, MAX_BUDGETS};

pub(super) use ops::{AdmitBatch, Debit, Lease, Peek, Recharge, Refund, Settle, Undo, Unspend};

/// An operation's script: the shared helpers (they start with the `#!lua` flag line), those
/// `admit_one` does not call (`extra.lua`; a script's functions are made anew on every call,
/// so the hot call makes only its own), then the operation's own file.
macro_rules! store_lua {
    ($op:literal) => {
        concat!(
            include_str!("../lua/store/common.lua"),
            include_str!("../lua/store/extra.lua"),
            include_str!(concat!("../lua/store/", $op, ".lua"))
        )
    };
}

/// The store's scripts, one per operation (the index of each in [`SOURCES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lua {
    Admit,
    AdmitOne,
    Undo,
    Refund,
    Debit,
    Settle,
    Unspend,
    Peek,
    Lease,
    AdmitBatch,
}

/// Each operation's script by name, in the order of [`Lua`]. The admitting scripts answer
/// packed (`pack.lua`, [`Packed`]).
pub(super) const SOURCES: [(&str, &str); 10] = [
    (
        "admit",
        concat!(
            include_str!("../lua/store/common.lua"),
            include_str!("../lua/store/extra.lua"),
            include_str!("../lua/store/pack.lua"),
            include_str!("../lua/store/admit.lua"),
        ),
    ),
    (
        "admit_one",
        concat!(
            include_str!("../lua/store/common.lua"),
            include_str!("../lua/store/pack.lua"),
            include_str!("../lua/store/admit_one.lua"),
        ),
    ),
    ("undo", store_lua!("undo")),
    ("refund", store_lua!("refund")),
    ("debit", store_lua!("debit")),
    ("settle", store_lua!("settle")),
    ("unspend", store_lua!("unspend")),
    ("peek", store_lua!("peek")),
    ("lease", store_lua!("lease")),
    // Group commit: `admit_one` and `admit` as functions of their KEYS and ARGV (which
    // shadow the call's own), then the batch that calls them in turn.
    (
        "admit_batch",
        concat!(
            include_str!("../lua/store/common.lua"),
            include_str!("../lua/store/extra.lua"),
            include_str!("../lua/store/pack.lua"),
            "local function admit_one(KEYS, ARGV)\n",
            include_str!("../lua/store/admit_one.lua"),
            "end\nlocal function admit(KEYS, ARGV)\n",
            include_str!("../lua/store/admit.lua"),
            "end\n",
            include_str!("../lua/store/admit_batch.lua"),
        ),
    ),
];

/// The scripts, in the order of [`Lua`] (each one's SHA1 is computed once).
static SCRIPTS: LazyLock<[Script; 10]> = LazyLock::new(|| SOURCES.map(|(_, lua)| Script::new(lua)));

/// The SHA1 an operation's script is sent by (`EVALSHA`), by its name in [`SOURCES`]: what
/// a test that holds one kind of call on the wire looks for.
pub fn script_sha(name: &str) -> Option<String> {
    let i = SOURCES.iter().position(|(n, _)| *n == name)?;
    Some(SCRIPTS[i].get_hash().to_string())
}

/// One operation of the store: a value whose fields are its arguments, and the script that
/// runs it.
pub(super) trait Op {
    /// What the script answers.
    type Reply: FromRedisValue;
    /// Its script.
    const SCRIPT: Lua;
    /// Its KEYS and ARGV, in the order of the contract above its script.
    fn args(&self, call: &mut Call<'static>);

    /// The call, ready to send ([`invoke`]).
    fn invocation(&self) -> Call<'static> {
        let mut call = Call::new(&SCRIPTS[Self::SCRIPT as usize]);
        self.args(&mut call);
        call
    }
}

/// One call of a script: its KEYS and its ARGV, each laid as it comes into one buffer of its
/// own (a [`Cmd`] keeps all its arguments' bytes in one growing `Vec`), and sent as
/// `EVALSHA sha numkeys KEYS... ARGV...`. Where redis-rs's `ScriptInvocation` allocates a
/// `Vec` for each argument and copies each again into the command it sends: a dozen
/// allocations per `admit`.
#[derive(Clone)]
pub(super) struct Call<'a> {
    script: &'a Script,
    keys: Cmd,
    argv: Cmd,
}

impl<'a> Call<'a> {
    pub fn new(script: &'a Script) -> Self {
        Call {
            script,
            keys: Cmd::with_capacity(4, 128),
            argv: Cmd::with_capacity(16, 128),
        }
    }

    pub fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.arg(key);
        self
    }

    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.argv.arg(arg);
        self
    }

    /// The command on the wire.
    fn eval(&self) -> Cmd {
        let (keys, argv) = (self.keys.args_iter(), self.argv.args_iter());
        let n = keys.len() + argv.len();
        let mut cmd = Cmd::with_capacity(3 + n, 64 + 24 * n);
        cmd.arg("EVALSHA")
            .arg(self.script.get_hash())
            .arg(keys.len());
        for a in keys.chain(argv) {
            // `Cmd::arg` lays only simple arguments (a cursor is `Cmd::cursor_arg`'s).
            if let redis::Arg::Simple(bytes) = a {
                cmd.arg(bytes);
            }
        }
        cmd
    }
}

/// Runs one script call (EVALSHA, and on NOSCRIPT — a restarted node, a promoted replica —
/// SCRIPT LOAD and EVALSHA again), resending it only when the answer proves it
/// did not run: MOVED or READONLY (Redis checks the slot and the role before running a
/// script; the cluster client re-reads its slot map on either). Never after a timeout or a
/// dropped connection: the script may have run, and it may charge. An ASK (a slot being
/// migrated right now) is not followed: it is an error, and `store.on_error` decides.
pub(super) async fn invoke<T: FromRedisValue>(
    call: &Call<'_>,
    conn: &mut Conn,
) -> Result<T, RedisError> {
    const RESENDS: usize = 2;
    let eval = call.eval();
    let mut resent = 0;
    loop {
        let sent = match eval.query_async::<T>(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                call.script.load_async(conn).await?;
                eval.query_async::<T>(conn).await
            }
            r => r,
        };
        match sent {
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
/// `noeviction`: OOM — the store's scripts are flagged, so Redis checks its role and
/// memory before running it), or the script stopped with an error at one of its checks,
/// which every operation makes before its first write. Anything but a reply (a broken
/// connection, a timeout) is not this.
pub(crate) fn refused_before_running(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    )
}

/// Whether a call that failed with `e` may have run: not when the connection was refused or
/// Redis answered with an error ([`refused_before_running`]).
pub(crate) fn may_have_run(e: &RedisError) -> bool {
    !e.is_connection_refusal() && !refused_before_running(e)
}

/// What an admitting call sent again after its first send failed with `first` answers: the
/// resend's outcome, but the first failure when the resend surely did not run while the first
/// may have (only that failure has the admission undone by its id).
pub(super) fn after_resend<T>(
    first: RedisError,
    again: redis::RedisResult<T>,
) -> redis::RedisResult<T> {
    match again {
        Err(e) if may_have_run(&first) && !may_have_run(&e) => Err(first),
        again => again,
    }
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

/// `admit` (`lua/store/admit.lua`): decides one request and, when it passes, charges it and
/// takes its slots; its arguments, owned so that the call can outlive its request. Writes
/// only when admitted (to every budget), and the settling always. Charges: never retry it
/// after a timeout. Reply: see [`parse_admit`].
#[derive(Debug, Clone)]
pub(super) struct AdmitCall {
    pub budget: String,
    pub key_slots: Option<String>,
    pub limit: Limit,
    pub cost: u64,
    pub key_cap: u32,
    /// The call's admission id (unique across the fleet), also the id of the leases it takes.
    pub lease_id: String,
    /// Where Redis records the admission by its id (`keys::admission_key`, the key's slot).
    pub record: String,
    /// How long the record lives, ms: at most this (shorter once the charge drained), or,
    /// negative, exactly its magnitude (a capped route's charge; `record_px`, `common.lua`).
    pub record_ms: i64,
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
    /// Every budget of the call, the first one first (for a refund of all of them).
    pub fn budgets(&self) -> Vec<(String, Limit)> {
        std::iter::once((self.budget.clone(), self.limit))
            .chain(self.also.iter().cloned())
            .collect()
    }

    /// The lease sets this call takes a slot in.
    pub fn slot_keys(&self) -> Vec<String> {
        self.key_slots.iter().cloned().collect()
    }
}

/// The admitting scripts' reply (`admit`, `admit_one`, `admit_batch`): each call's figures, in
/// order, unpacked from the one string they come in (`lua/store/pack.lua`: a count, then that
/// many signed 64-bit little-endian integers, per call). One string is one value for the
/// Redis client to parse, where an array of integers was one per figure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Packed(pub Vec<Vec<i64>>);

impl Packed {
    /// The reply of a call sent alone: exactly one call's figures.
    pub fn one(self) -> Result<Vec<i64>, RedisError> {
        let n = self.0.len();
        match <[Vec<i64>; 1]>::try_from(self.0) {
            Ok([r]) => Ok(r),
            Err(_) => Err(ParsingError::from(format!("one admission answered {n}")).into()),
        }
    }
}

/// `bytes` as [`Packed`] replies, `None` if they are not exactly that (a count past the end,
/// a word cut short, bytes left over).
pub(super) fn unpack(mut bytes: &[u8]) -> Option<Vec<Vec<i64>>> {
    fn word(bytes: &mut &[u8]) -> Option<i64> {
        let (w, rest) = bytes.split_first_chunk::<8>()?;
        *bytes = rest;
        Some(i64::from_le_bytes(*w))
    }
    let mut calls = Vec::new();
    while !bytes.is_empty() {
        let n = usize::try_from(word(&mut bytes)?).ok()?;
        if n > bytes.len() / 8 {
            return None;
        }
        calls.push(
            (0..n)
                .map(|_| word(&mut bytes))
                .collect::<Option<Vec<i64>>>()?,
        );
    }
    Some(calls)
}

impl FromRedisValue for Packed {
    fn from_redis_value_ref(v: &Value) -> Result<Self, ParsingError> {
        match v {
            Value::BulkString(bytes) => unpack(bytes).map(Packed).ok_or_else(|| {
                format!(
                    "a packed reply of {} bytes that does not unpack",
                    bytes.len()
                )
                .into()
            }),
            other => Err(format!("{other:?} where a packed reply was expected").into()),
        }
    }

    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        Self::from_redis_value_ref(&v)
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

/// How long a capped route's admission record lives (`admit_call`): past the time its request
/// may wait in the queue, as long as an admission's record lives.
pub(super) fn record_kept_for(queue_timeout: Duration) -> Duration {
    queue_timeout.saturating_add(ADMISSION_RECORD)
}

/// Until when (Redis time, µs) a record written at `kept_us` for `kept_for` surely lives: less
/// a second, for the expiry's millisecond rounding and a call's own time.
pub(super) fn record_lives_until(kept_us: u64, kept_for: Duration) -> u64 {
    kept_us + (kept_for.as_micros() as u64).saturating_sub(1_000_000)
}

/// How long an undone id's tombstone keeps a late delivery of its call from charging: past
/// the time a kernel keeps retransmitting a closed connection's unsent data (~15 min).
pub(super) const TOMBSTONE: Duration = Duration::from_secs(20 * 60);
/// How long the gateway keeps sending the `undo` of a call it gave up on.
pub(super) const UNDO_FOR: Duration = Duration::from_secs(100);

mod ops;

#[cfg(test)]
mod tests;
