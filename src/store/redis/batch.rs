//! Group commit. A worker thread has at most [`MAX_IN_FLIGHT`] admitting calls in flight; the
//! admissions that arrive while it has that many wait in its lane, and then go to Redis
//! together: one `admit_batch` call (`lua/store/admit_batch.lua`) that decides each in the
//! order they came, exactly as if each had been sent alone at the batch's moment (one Redis
//! `TIME`, read once). Under load a thread so makes one round trip, and Redis runs one script,
//! for many requests; a lone request goes alone, at once, as before. Nothing depends on the
//! order Redis runs a thread's two calls in (after a failure the next may go on a new
//! connection): each admission is decided as if alone, a batch's in the order they came.
//!
//! Each admission keeps everything it had alone: its own id and record (so a batch that timed
//! out is undone request by request, by id, as one call is: `admit::deliver`), its own reply,
//! its own `store.timeout`. A request that gave up while waiting in the lane is not sent at
//! all. Only on one node (or a Sentinel's primary): on Redis Cluster one script's keys must
//! share a slot, and different keys' budgets do not, so each call goes alone there.

use std::sync::{Arc, Mutex};

use super::admit::Sent;
use super::conn::Conn;
use super::script::{self, AdmitBatch, AdmitCall, Op, Packed};
use super::RedisBackend;
use crate::store::{lock, StoreError};

/// The most admissions one batch decides (Redis runs nothing else while a script runs).
pub(super) const MAX_BATCH: usize = 64;

/// The most admitting calls one worker thread has in flight. With one, an admission that
/// arrives just after a call left waits the rest of that call's round trip and then its own:
/// 1.5 round trips on average under load, 2 at worst, which is what a Redis a network away
/// makes users feel. With two it goes at once beside it (only a third waits), while what
/// arrives under heavier load still gathers into batches.
pub(super) const MAX_IN_FLIGHT: usize = 2;

/// One worker thread's admissions: how many of its calls are in flight, and what waits for
/// them.
#[derive(Default)]
pub(super) struct Lane {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    flying: usize,
    waiting: Vec<(AdmitCall, Sent)>,
}

impl Lane {
    /// Queues admission `c` behind the calls in flight when there are [`MAX_IN_FLIGHT`];
    /// else gives it back: the caller sends it now, as one more call in flight, until
    /// [`Lane::next`] finds nothing waiting for it.
    pub(super) fn enter(&self, c: AdmitCall, tx: Sent) -> Option<(AdmitCall, Sent)> {
        let mut s = lock(&self.state);
        if s.flying >= MAX_IN_FLIGHT {
            s.waiting.push((c, tx));
            return None;
        }
        s.flying += 1;
        Some((c, tx))
    }

    /// For a call that landed: what waited meanwhile (at most [`MAX_BATCH`]), to send next in
    /// its place, or `None`: one call fewer is in flight.
    fn next(&self) -> Option<Vec<(AdmitCall, Sent)>> {
        let mut s = lock(&self.state);
        if s.waiting.is_empty() {
            s.flying -= 1;
            return None;
        }
        let n = s.waiting.len().min(MAX_BATCH);
        Some(s.waiting.drain(..n).collect())
    }
}

impl RedisBackend {
    /// Sends `first` alone (fewer than [`MAX_IN_FLIGHT`] calls were in flight), then each
    /// batch that gathered meanwhile, until none did.
    pub(super) async fn run_lane(
        self: Arc<Self>,
        lane: Arc<Lane>,
        first: (AdmitCall, Sent),
        mut conn: Conn,
    ) {
        let (c, tx) = first;
        let reply = self.run_admit(&c, &mut conn).await;
        self.deliver(c, tx, reply);
        while let Some(mut batch) = lane.next() {
            // Gone while waiting: never sent, so nothing to undo.
            batch.retain(|(_, tx)| !tx.is_closed());
            if batch.is_empty() {
                continue;
            }
            // The thread's connection now: a failed call's was forgotten.
            let mut conn = match self.conns.get().await {
                Ok(conn) => conn,
                Err(e) => {
                    for (c, tx) in batch {
                        self.deliver(c, tx, Err(e.clone()));
                    }
                    continue;
                }
            };
            if batch.len() == 1 {
                let (c, tx) = batch.pop().expect("one");
                let reply = self.run_admit(&c, &mut conn).await;
                self.deliver(c, tx, reply);
            } else {
                self.run_batch(batch, &mut conn).await;
            }
        }
    }

    /// One `admit_batch` call, each admission's reply delivered to its request.
    async fn run_batch(self: &Arc<Self>, batch: Vec<(AdmitCall, Sent)>, conn: &mut Conn) {
        let (calls, txs): (Vec<AdmitCall>, Vec<Sent>) = batch.into_iter().unzip();
        let call = AdmitBatch(&calls).invocation();
        let replies = script::invoke::<Packed>(&call, conn).await;
        let replies = self.resent_if_dropped(replies, &call, conn).await;
        let replies: Vec<Result<Vec<i64>, StoreError>> = match replies {
            Ok(Packed(each)) if each.len() == calls.len() => {
                each.into_iter().map(one_of_batch).collect()
            }
            // Not this batch's answer: each may have run.
            Ok(Packed(each)) => (0..calls.len())
                .map(|_| {
                    Err(StoreError::Reply(format!(
                        "a batch of {} answered {each:?}",
                        calls.len()
                    )))
                })
                .collect(),
            Err(e) => (0..calls.len()).map(|_| Err(e.clone().into())).collect(),
        };
        for ((c, tx), reply) in calls.into_iter().zip(txs).zip(replies) {
            self.deliver(c, tx, reply);
        }
    }
}

/// One admission's reply in a batch's: `[-1]` is a call that stopped with an error, having
/// written nothing (as a script error reply of a call sent alone says).
fn one_of_batch(reply: Vec<i64>) -> Result<Vec<i64>, StoreError> {
    if reply.first() == Some(&-1) {
        let e = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "an admission of a batch stopped with an error in its script",
        ));
        return Err(e.into());
    }
    Ok(reply)
}

#[cfg(test)]
mod tests;
