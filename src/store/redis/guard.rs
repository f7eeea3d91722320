//! The one way a call reaches Redis: [`RedisBackend::guarded`] takes the connection, bounds
//! the call in time and, on the request path, asks the circuit breaker first and counts the
//! outcome (metrics, breaker, the connection of a failed call forgotten). What charges is
//! never retried here: a call that timed out may have run.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::script::{self, Op};
use super::RedisBackend;
use crate::store::StoreError;
use crate::telemetry::{metrics, StoreCall};

/// How one call is guarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Guard {
    /// Refused while the breaker is open; bounded by `store.timeout` once connected; counted.
    Breaker,
    /// The charging call (`admit`): as [`Guard::Breaker`], but its `store.timeout` counts
    /// from before connecting: the request waits no longer than that for its decision.
    Charge,
    /// The store probe: as [`Guard::Breaker`], but a refusal by the open breaker is not
    /// counted (the probe asks again every second while the store is down), and a failure
    /// does not count towards opening the breaker: the probe also asks while the instance is
    /// idle, and an instance that saw the store fail only that way answers its next request
    /// from the store, not from an open breaker.
    Probe,
    /// Past the breaker and uncounted, bounded by the time given: what must reach Redis even
    /// while the breaker is open (an admission's undo, a refund owed, leases registered
    /// again after Redis lost its data).
    Bypass(Duration),
}

impl RedisBackend {
    /// Runs `work` on this thread's connection, guarded as `guard` says.
    pub(super) async fn guarded<T, F, Fut>(&self, guard: Guard, work: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let counted = !matches!(guard, Guard::Bypass(_));
        if counted && !self.breaker.allow() {
            let res = Err(StoreError::BreakerOpen);
            if guard != Guard::Probe {
                self.record(Instant::now(), &res, true);
            }
            return res;
        }
        let start = Instant::now();
        let res = async {
            let conn = self.conns.get().await?;
            let within = match guard {
                Guard::Bypass(d) => d,
                Guard::Charge => self.timeout.saturating_sub(start.elapsed()),
                Guard::Breaker | Guard::Probe => self.timeout,
            };
            tokio::time::timeout(within, work(conn))
                .await
                .unwrap_or(Err(StoreError::Timeout))
        }
        .await;
        if counted {
            self.record(start, &res, guard != Guard::Probe);
        } else if res.as_ref().is_err_and(distrusts_connection) {
            // Uncounted, but a broken or timed-out connection is no more trusted than a
            // counted call's: a check that runs for the store's life would otherwise keep
            // failing on a connection the server closed.
            self.conns.forget();
        }
        res
    }

    /// One script call under the breaker and `store.timeout`, counted. For calls that charge
    /// nothing (leases, peeks, refunds, settlings, queues); `admit` is `call_admit`.
    pub(super) async fn call<T: redis::FromRedisValue>(
        &self,
        inv: script::Call<'_>,
    ) -> Result<T, StoreError> {
        self.call_guarded(Guard::Breaker, inv).await
    }

    /// [`Self::call`] of an operation that changes nothing more when it runs twice (a read, a
    /// grant's confirmation, a lease's release): one whose connection turns out closed as it
    /// is sent (Redis closed it since the connection was last looked at: an idle `timeout`,
    /// `CLIENT KILL`, a restart) is sent once more, on a new connection, within the same
    /// guarded call: only its last outcome counts (metrics, breaker), so that the resend is
    /// not refused by a breaker the first failures opened. It may have run the first time;
    /// running again is the same.
    pub(super) async fn call_repeatable<T: redis::FromRedisValue>(
        &self,
        inv: script::Call<'_>,
    ) -> Result<T, StoreError> {
        self.call_repeatable_guarded(Guard::Breaker, inv).await
    }

    /// [`Self::call_repeatable`], guarded as `guard` says.
    pub(super) async fn call_repeatable_guarded<T: redis::FromRedisValue>(
        &self,
        guard: Guard,
        inv: script::Call<'_>,
    ) -> Result<T, StoreError> {
        self.guarded(guard, |mut conn| async move {
            match script::invoke::<T>(&inv, &mut conn).await {
                Err(e) if e.is_connection_dropped() => {
                    self.conns.forget();
                    let mut fresh = self.conns.get().await?;
                    Ok(script::invoke::<T>(&inv, &mut fresh).await?)
                }
                res => Ok(res?),
            }
        })
        .await
    }

    /// One operation of the store's scripts, as [`Self::call_repeatable`].
    pub(super) async fn op_repeatable<O: Op>(&self, op: &O) -> Result<O::Reply, StoreError> {
        self.call_repeatable(op.invocation()).await
    }

    /// One script call, guarded as `guard` says.
    pub(super) async fn call_guarded<T: redis::FromRedisValue>(
        &self,
        guard: Guard,
        inv: script::Call<'_>,
    ) -> Result<T, StoreError> {
        self.guarded(guard, |mut conn| async move {
            Ok(script::invoke::<T>(&inv, &mut conn).await?)
        })
        .await
    }

    /// One operation of the store's scripts, as [`Self::call`].
    pub(super) async fn op<O: Op>(&self, op: &O) -> Result<O::Reply, StoreError> {
        self.call(op.invocation()).await
    }

    /// One operation past the breaker, uncounted, bounded by `within` ([`Guard::Bypass`]).
    pub(super) async fn op_bypassing<O: Op>(
        &self,
        op: &O,
        within: Duration,
    ) -> Result<O::Reply, StoreError> {
        let inv = op.invocation();
        self.guarded(Guard::Bypass(within), |mut conn| async move {
            Ok(script::invoke::<O::Reply>(&inv, &mut conn).await?)
        })
        .await
    }

    /// Metrics, breaker and connection health after one call. A call the open breaker
    /// refused (or held back during a failover) never went to Redis: it is counted but has
    /// no duration, so the latency histogram describes Redis only.
    fn record<T>(&self, start: Instant, res: &Result<T, StoreError>, opens: bool) {
        let m = metrics();
        match res {
            Ok(_) => {
                let now = Instant::now();
                let took = now.saturating_duration_since(start);
                m.store_duration.observe(took.as_secs_f64());
                self.breaker.answered_slowly(now, took);
                m.store_call(StoreCall::Ok);
                if let Some(quiet) = self.breaker.success(now) {
                    self.conns.run_id.answered_after(quiet, self.lease_ttl);
                }
            }
            Err(StoreError::BreakerOpen) => {
                m.store_call(StoreCall::BreakerOpen);
            }
            // Not sent: the store is not failing, it is changing primaries (but it does not
            // answer meanwhile).
            Err(e @ StoreError::FailingOver) => {
                self.breaker.failed();
                m.store_call(e.metric_label());
            }
            Err(e) => {
                self.breaker.failed();
                m.store_duration.observe(start.elapsed().as_secs_f64());
                m.store_call(e.metric_label());
                FAILED_CALLS.note(e);
                self.conns.forget();
                if opens && self.breaker.failure() {
                    // Once per opening, with the cause: a wrong password or an out-of-memory
                    // Redis needs an operator, a timeout may pass by itself.
                    tracing::warn!(error = %e, transient = e.transient(), "store unreachable: circuit breaker open");
                }
            }
        }
    }
}

/// Whether a failed call's connection is made again for the next call: not after the server's
/// own refusal (out of memory, NOSCRIPT, a script's error: the connection works, and the
/// calls that bypass the breaker are sent again and again while it lasts), but after a
/// timeout, a broken connection, or READONLY / MASTERDOWN (the primary is elsewhere now).
fn distrusts_connection(e: &StoreError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match e {
        StoreError::Redis { source, .. } => match source.kind() {
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown) => true,
            ErrorKind::Server(_) | ErrorKind::Extension => false,
            _ => true,
        },
        StoreError::BreakerOpen
        | StoreError::FailingOver
        | StoreError::Config(_)
        | StoreError::Reply(_) => false,
        StoreError::Timeout | StoreError::ConnectTimeout | StoreError::Connect(_) => true,
    }
}

/// How often at most a failed call is logged.
const FAILURES_LOGGED_EVERY: Duration = Duration::from_secs(10);

/// Failed calls, logged at WARN with their cause (DESIGN §5: "Store errors are logged with
/// their cause"): the first at once, then at most one line per [`FAILURES_LOGGED_EVERY`]
/// with how many failed since the last line, so that a Redis that fails every call does not
/// fill the log (`tollgate_store_calls_total` counts each).
struct FailureLog {
    /// Ms after `since` before which nothing more is logged.
    next_ms: AtomicU64,
    unlogged: AtomicU64,
    since: OnceLock<Instant>,
}

static FAILED_CALLS: FailureLog = FailureLog {
    next_ms: AtomicU64::new(0),
    unlogged: AtomicU64::new(0),
    since: OnceLock::new(),
};

impl FailureLog {
    fn note(&self, e: &StoreError) {
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        let now = self.since.get_or_init(Instant::now).elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        let every = FAILURES_LOGGED_EVERY.as_millis() as u64;
        if now < next
            || (self.next_ms)
                .compare_exchange(next, now + every, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let failed = self.unlogged.swap(0, Ordering::Relaxed);
        // The time the count covers: since the last line (none before the first).
        let over_s = match next {
            0 => 0,
            _ => now.saturating_sub(next - every) / 1000,
        };
        tracing::warn!(error = %e, transient = e.transient(), failed, over_s, "store calls failed (logged at most every 10 s; `failed`: how many in the `over_s` seconds since the last line)");
    }
}

#[cfg(test)]
mod tests {
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::*;

    fn redis(kind: ErrorKind) -> StoreError {
        StoreError::from(RedisError::from((kind, "test")))
    }

    #[test]
    fn a_servers_own_refusal_keeps_the_connection_a_broken_one_does_not() {
        let io = StoreError::from(RedisError::from(std::io::Error::from(
            std::io::ErrorKind::BrokenPipe,
        )));
        for e in [
            io,
            StoreError::Timeout,
            StoreError::ConnectTimeout,
            redis(ErrorKind::Server(ServerErrorKind::ReadOnly)),
            redis(ErrorKind::Server(ServerErrorKind::MasterDown)),
        ] {
            assert!(distrusts_connection(&e), "{e}");
        }
        for e in [
            redis(ErrorKind::Server(ServerErrorKind::NoScript)),
            redis(ErrorKind::Server(ServerErrorKind::ResponseError)),
            redis(ErrorKind::Extension),
            StoreError::FailingOver,
            StoreError::Reply("x".into()),
        ] {
            assert!(!distrusts_connection(&e), "{e}");
        }
    }
}
