//! Taking a fleet job that never ran out of its route's queue: a `DELETE` (cancelled), or
//! `result_ttl` waited (expired: by a poll, the collectors' look at the oldest, or the claim
//! of its slot); each refunded once, by the caller whose record operation moved it. An
//! operation carries a token, so that one Redis ran but whose answer was lost is sent again
//! and answered as it was: its caller still refunds (`lua/jobs.lua`).

use std::sync::Arc;
use std::time::Duration;

use super::super::metrics::{self, JobResult};
use super::super::Cancel;
use super::record::{self, ended_unrun, field, payer, read, text};
use super::{backend, charged, EXPIRE_LOOKS_AT};
use crate::identity::{Identity, KeyHash};
use crate::state::{Running, Shared};
use crate::store::redis::RedisBackend;
use crate::store::{Charge, StoreError};

/// How long a take-out that Redis may have run, unanswered, is sent again with its token.
const AGAIN_FOR: Duration = Duration::from_secs(2);

/// A record operation's token: a resend with it is the same operation.
pub(super) fn token() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// `DELETE`: takes a queued job out of its queue (refunded); `Started` once it runs or ran;
/// `Gone` once cancelled (by another `DELETE` just now: its poll is 404 too) or gone; an
/// error: Redis did not answer (it may be cancelled: the caller asks again).
pub async fn cancel(
    shared: &Shared,
    running: &Running,
    id: &str,
    who: &Identity,
) -> Result<Cancel, StoreError> {
    let Some(b) = backend(shared) else {
        return Ok(Cancel::Gone);
    };
    let Some(r) = read(b, id).await? else {
        return Ok(Cancel::Gone);
    };
    if take_out(shared, running, b, (id, &r), who, "cancel").await? {
        return Ok(Cancel::Cancelled);
    }
    // Not queued, as read, or no longer when its cancel came: what it is now.
    let now = match field(&r, "state") {
        b"queued" => read(b, id).await?,
        _ => Some(r),
    };
    Ok(match now.as_ref().map(|r| field(r, "state")) {
        None | Some(b"cancelled") => Cancel::Gone,
        Some(_) => Cancel::Started,
    })
}

/// Takes queued job `id` (of record `r`, as its caller read it) out of its route's queue as
/// record operation `op` (`cancel`, or `expire` once it has waited result_ttl) and refunds
/// it; `false`: it was not queued (or not due), nothing changed. (The record's operation
/// decides, whatever changed since `r` was read.) An operation Redis may have run unanswered
/// is sent again, with its token, for [`AGAIN_FOR`]; an error: it went unanswered so long
/// (or surely did not run).
pub(super) async fn take_out(
    shared: &Shared,
    running: &Running,
    b: &RedisBackend,
    (id, r): (&str, &record::Record),
    who: &Identity,
    op: &str,
) -> Result<bool, StoreError> {
    let label = text(r, "route");
    if field(r, "state") != b"queued" {
        return Ok(false);
    }
    // The record decides first: a collector that claimed it keeps it (and its slot); once it
    // is out, a grant that finds it so passes the slot on.
    if with_token(b, id, op, StoreError::may_have_run).await? != 1 {
        return Ok(false);
    }
    let key = key_slot(who);
    if matches!(b.job_leave(&label, id).await, Ok(1)) {
        // Granted meanwhile: the slot goes on to the next waiter.
        let _ = b.job_release(&label, id, key).await;
    } else if let Some(key) = key {
        let _ = b.job_release_key(key, id).await;
    }
    refund(shared, running, r, who).await;
    let result = if op == "cancel" {
        JobResult::Cancelled
    } else {
        JobResult::Expired
    };
    ended_unrun(running, r, id, result);
    Ok(true)
}

/// Cancels the record of a job refused by its queue, or that may have entered it unanswered,
/// whose charge was given back: a grant that finds it so passes the slot on, and neither it
/// runs nor an expiry refunds it again. Sent again with its token while Redis does not
/// answer, for [`AGAIN_FOR`].
pub(super) async fn withdraw(b: &RedisBackend, id: &str) {
    if let Err(e) = with_token(b, id, "cancel", |_| true).await {
        tracing::warn!(job = id, error = %e, "a job whose charge was given back could not be cancelled");
    }
}

/// Record operation `op` (a cancel or an expiry) of job `id`, with a token of its own: a try
/// that failed as `again_if` says needs it is sent again with that token, for [`AGAIN_FOR`]
/// (`record::sent_again`), and answered as the one Redis ran; an error: none was answered.
async fn with_token(
    b: &RedisBackend,
    id: &str,
    op: &str,
    again_if: fn(&StoreError) -> bool,
) -> Result<i64, StoreError> {
    let token = token();
    let args: [&[u8]; 1] = [token.as_bytes()];
    let call = || b.job_record::<i64>(id, op, &args);
    match call().await {
        Err(e) if again_if(&e) => {
            tracing::debug!(job = id, op, error = %e, "a job's record operation went unanswered: sent again");
            record::sent_again(tokio::time::Instant::now() + AGAIN_FOR, call).await
        }
        answered => answered,
    }
}

/// The key whose slot a job of `who` holds: its plan's `max_in_flight_per_key` counts jobs
/// (`RedisBackend::enter_job`), as `decision::admit_request` sets `key_cap`.
pub(super) fn key_slot(who: &Identity) -> Option<&KeyHash> {
    who.policy.max_in_flight_per_key.map(|_| &who.hash)
}

/// Gives back the charge of the job of record `r`, paid by `who`, that never ran: what it was
/// charged (`charged`), even if a reload changed or removed its route since.
async fn refund(shared: &Shared, running: &Running, r: &record::Record, who: &Identity) {
    let route = running.config.router.by_label(&text(r, "route"));
    if let Some(admit) = charged::admit_of(r, route.map(|r| &**r), who) {
        shared.store.refund(&admit, Charge::Shared).await;
    }
}

/// A job whose claim found it waited result_ttl (now `expired`): refunded, its slot passed on.
/// Its record (what it was charged) is read again while Redis does not answer, for
/// [`AGAIN_FOR`].
pub(super) async fn expired(shared: &Shared, b: &RedisBackend, id: &str, label: &str) {
    let running = shared.running();
    let read = || record::read_expired(b, id);
    let r = match read().await {
        Ok(r) => r,
        Err(_) => record::sent_again(tokio::time::Instant::now() + AGAIN_FOR, read)
            .await
            .ok()
            .flatten(),
    };
    let who = r.as_ref().and_then(|r| payer(&running, field(r, "key")));
    let key = who.as_ref().and_then(key_slot);
    let _ = b.job_release(label, id, key).await;
    if let (Some(who), Some(r)) = (who, &r) {
        refund(shared, &running, r, &who).await;
    }
    match r {
        Some(r) => ended_unrun(&running, &r, id, JobResult::Expired),
        None => metrics::ended(label, JobResult::Expired),
    }
}

/// Expires (and refunds) the oldest queued jobs on `label` that have waited `result_ttl`,
/// whether or not anyone polls them, as the memory store's jobs expire themselves; the
/// record decides, once, by Redis's clock (`lua/jobs.lua` `expire`), so the fleet's
/// collectors may all look. Oldest first: it stops at the first one not due yet, unless that
/// one was held for its `max_delay` turn (its `result_ttl` counts from its due time, later than
/// its place in the queue says); and at the first Redis did not answer.
pub(super) async fn expire_overdue(
    shared: &Arc<Shared>,
    running: &Running,
    b: &RedisBackend,
    label: &str,
) {
    let Ok(ids) = b.queued_jobs(label, EXPIRE_LOOKS_AT).await else {
        return;
    };
    for id in ids {
        let Ok(Some(r)) = read(b, &id).await else {
            continue;
        };
        if record::uncounted(&r) {
            // Its runner gone (`job-lost`): counted and logged once, by whoever takes it.
            record::count_lost(running, b, &id).await;
            continue;
        }
        let Some(who) = payer(running, field(&r, "key")) else {
            continue;
        };
        if field(&r, "state") != b"queued" {
            continue;
        }
        if !record::overdue(&r) {
            if record::delay(&r).is_zero() {
                return;
            }
            continue;
        }
        if take_out(shared, running, b, (&id, &r), &who, "expire")
            .await
            .is_err()
        {
            return;
        }
    }
}
