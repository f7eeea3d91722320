//! Asynchronous requests (DESIGN §8, RFC 7240 `Prefer: respond-async`): a request on an
//! `async:` route is charged, answered at once with 202 and a job location, and waits in the
//! route's fair queue as a waiter that no client connection holds. Whichever task gets the
//! slot sends the request the synchronous path would have sent and keeps the upstream's answer
//! for `result_ttl`, for the same key to read at `/_tollgate/jobs/<id>`.
//!
//! - this file: a job, its states, and the [`Board`] of this process's jobs;
//! - `charge`: a job's charge, made before its body is read, and given back if no job is made;
//! - `run`: a job's life from its place in the queue to its result;
//! - `send`: the job's request to the upstream, and the answer read back;
//! - `metrics`: `tollgate_jobs_total{route,result}` and `tollgate_jobs{route,state}`;
//! - `fleet`: jobs on Redis (one node or Sentinel), which outlive the instance that took them.
//!
//! On the memory store jobs live in the process and end with it.

mod charge;
pub mod describe;
pub mod fleet;
mod metrics;
mod run;
mod send;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::identity::KeyHash;
use crate::store::fair::Place;
use crate::store::lock;

pub use charge::{charge, Charged};
pub use metrics::{announce, counts as gauge_counts};
pub use run::{Origin, Submission};
pub use send::JobRequest;

/// Where a job's status is read: `/_tollgate/jobs/<id>` on the proxy listener.
pub const PATH_PREFIX: &str = "/_tollgate/jobs/";

/// A response as the upstream gave it (hop-by-hop headers left out), or the gateway's problem
/// JSON when the job failed.
#[derive(Debug, Clone)]
pub struct Stored {
    pub status: u16,
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    pub body: Bytes,
}

#[derive(Debug)]
enum Status {
    /// Waiting for a slot; the place answers "how many are ahead" (`None`: a slot at once).
    Queued(Option<Place>),
    Running,
    Done {
        result: Arc<Stored>,
        until: Instant,
    },
    /// `DELETE` took it out of the queue; its task refunds and forgets it.
    Cancelled,
}

/// One job: whose it is, where it stands.
#[derive(Debug)]
pub struct Job {
    pub id: Arc<str>,
    key: KeyHash,
    pub route: Arc<str>,
    status: Mutex<Status>,
    /// Wakes the job's task when `DELETE` cancels it while queued.
    cancel: Mutex<Option<oneshot::Sender<()>>>,
    /// Told when its task gave a charge back (a job that left the queue without running).
    refunded: tokio::sync::Notify,
    /// What it holds in memory (its request body, then its result's), counted in the board.
    bytes: AtomicU64,
    /// When its reserved units are due (`max_delay`): it is sent no sooner.
    due: Instant,
}

/// A job as a poll sees it.
#[derive(Debug, Clone)]
pub enum View {
    /// Waiting; `position` is its place in the fair order, 1 for the next (0: holding a slot,
    /// about to run).
    Queued {
        position: usize,
        /// Until its reserved units are due (`max_delay`): it is sent no sooner.
        due_in: Duration,
    },
    /// Running, or holding its slot until its units are due (in `due_in`).
    Running {
        due_in: Duration,
    },
    Done(Arc<Stored>),
}

/// Longest a `DELETE` waits for the cancelled job's refund before it answers.
const REFUND_WAIT: Duration = Duration::from_secs(1);

/// What `DELETE` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancel {
    /// Taken out of the queue; its charge is given back.
    Cancelled,
    /// Already running or finished: 409.
    Started,
    /// Cancelled already (by another `DELETE` just now), or gone: 404, as its poll.
    Gone,
}

impl Job {
    pub fn view(&self) -> Option<View> {
        match &*lock(&self.status) {
            Status::Queued(place) => Some(View::Queued {
                position: place.as_ref().and_then(Place::position).unwrap_or(0),
                due_in: self.due.saturating_duration_since(Instant::now()),
            }),
            Status::Running => Some(View::Running {
                due_in: self.due.saturating_duration_since(Instant::now()),
            }),
            Status::Done { result, until } if Instant::now() < *until => {
                Some(View::Done(result.clone()))
            }
            Status::Done { .. } | Status::Cancelled => None,
        }
    }

    /// Cancels the job if it is still queued. The status lock decides between a cancel and a
    /// slot granted at the same moment: whichever takes it first wins.
    pub async fn cancel(&self) -> Cancel {
        let refunded = self.refunded.notified();
        {
            let mut status = lock(&self.status);
            match &*status {
                Status::Queued(_) => {}
                Status::Cancelled => return Cancel::Gone,
                _ => return Cancel::Started,
            }
            *status = Status::Cancelled;
            if let Some(tx) = lock(&self.cancel).take() {
                let _ = tx.send(());
            }
        }
        // Its task gives the charge back; the answer waits for that (briefly), so that its
        // rate-limit headers show the units back.
        let _ = tokio::time::timeout(REFUND_WAIT, refunded).await;
        Cancel::Cancelled
    }

    /// The job got its slot: running from now on, unless it was cancelled first.
    fn start(&self) -> bool {
        let mut status = lock(&self.status);
        if matches!(*status, Status::Cancelled) {
            return false;
        }
        *status = Status::Running;
        true
    }

    /// Keeps `result` for `ttl`; the bytes it holds.
    fn finish(&self, result: Stored, ttl: Duration) -> u64 {
        let size = result.body.len()
            + result
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len())
                .sum::<usize>();
        *lock(&self.status) = Status::Done {
            result: Arc::new(result),
            until: Instant::now() + ttl,
        };
        size as u64
    }

    /// A job that left the queue without running: `false` if `DELETE` cancelled it, else it
    /// expired (no slot within `result_ttl`), which is its result for as long again.
    fn expire(&self, ttl: Duration) -> bool {
        let mut status = lock(&self.status);
        if matches!(*status, Status::Cancelled) {
            return false;
        }
        *status = Status::Done {
            result: Arc::new(run::expired_result()),
            until: Instant::now() + ttl,
        };
        true
    }
}

/// Most bytes of request bodies and kept results this process holds for jobs: beyond it a
/// submission is refused (503 `route-busy`, nothing charged) until results expire.
pub const MAX_HELD_BYTES: u64 = 1 << 30;

/// Every job of this process, by id: one board per process, like its metrics registry.
pub fn board() -> &'static Board {
    static BOARD: std::sync::OnceLock<Board> = std::sync::OnceLock::new();
    BOARD.get_or_init(Board::default)
}

/// Every job of this process, by id (see [`board`]).
#[derive(Debug, Default)]
pub struct Board {
    jobs: Mutex<HashMap<Arc<str>, Arc<Job>>>,
    last_sweep: Mutex<Option<Instant>>,
    /// The bytes the jobs hold (see [`MAX_HELD_BYTES`]).
    held: AtomicU64,
}

impl Board {
    /// The job `id` of the key `key`; `None` for another key's, an unknown or an expired one
    /// (all alike: 404, so ids of other keys cannot be probed).
    pub fn get(&self, id: &str, key: &KeyHash) -> Option<(Arc<Job>, View)> {
        self.sweep();
        let job = lock(&self.jobs).get(id).cloned()?;
        if job.key != *key {
            return None;
        }
        let view = job.view()?;
        Some((job, view))
    }

    /// Jobs of `route` queued and running in this process.
    pub fn counts(&self, route: &str) -> (usize, usize) {
        let jobs = lock(&self.jobs);
        let mut counts = (0, 0);
        for j in jobs.values().filter(|j| &*j.route == route) {
            match &*lock(&j.status) {
                Status::Queued(_) => counts.0 += 1,
                Status::Running => counts.1 += 1,
                _ => {}
            }
        }
        counts
    }

    fn insert(&self, job: Arc<Job>) {
        self.sweep();
        lock(&self.jobs).insert(job.id.clone(), job);
    }

    fn remove(&self, id: &str) {
        if let Some(j) = lock(&self.jobs).remove(id) {
            self.held
                .fetch_sub(j.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// Takes room for `n` more bytes, if the board has it.
    fn reserve(&self, n: u64) -> bool {
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                h.checked_add(n).filter(|t| *t <= MAX_HELD_BYTES)
            })
            .is_ok()
    }

    /// Gives back room taken for a job that was not made.
    fn unreserve(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::Relaxed);
    }

    /// The job now holds `n` bytes (its result instead of its request), whatever the bound.
    fn resize(&self, job: &Job, n: u64) {
        let was = job.bytes.swap(n, Ordering::Relaxed);
        self.held.fetch_add(n, Ordering::Relaxed);
        self.held.fetch_sub(was, Ordering::Relaxed);
    }

    /// Bytes held by this process's jobs.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Forgets the results past their `result_ttl`, at most once a second.
    fn sweep(&self) {
        let now = Instant::now();
        {
            let mut last = lock(&self.last_sweep);
            if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
                return;
            }
            *last = Some(now);
        }
        let mut freed = 0;
        lock(&self.jobs).retain(|_, j| match &*lock(&j.status) {
            Status::Done { until, .. } if now >= *until => {
                freed += j.bytes.load(Ordering::Relaxed);
                false
            }
            _ => true,
        });
        self.held.fetch_sub(freed, Ordering::Relaxed);
    }
}

/// A new job id: 128 random bits from the thread's CSPRNG, as 32 hex digits.
fn new_id() -> Arc<str> {
    Arc::from(hex::encode(rand::random::<u128>().to_be_bytes()))
}

/// A job on its way in, charged, its route known to take jobs: what either store's `submit`
/// is given (with what its charge holds there).
struct NewJob<'a> {
    running: Arc<crate::state::Running>,
    route: Arc<crate::route::Route>,
    rules: crate::route::AsyncRules,
    /// The route's `max_in_flight`: a job runs in one of its slots.
    cap: u32,
    who: &'a crate::identity::Identity,
    request: JobRequest,
    origin: Origin,
}

/// Makes a charged job (its whole body read) and queues it on the store in use (in this
/// process, or the fleet's in Redis); `Err` is the refusal of its queue, of this process's
/// bound or of the store, its charge given back (no job).
pub async fn submit(
    shared: &Arc<crate::state::Shared>,
    running: Arc<crate::state::Running>,
    route: Arc<crate::route::Route>,
    who: &crate::identity::Identity,
    charged: Charged,
    request: JobRequest,
    origin: Origin,
) -> Result<Submission, crate::store::Admission> {
    let (Some(rules), Some(cap)) = (route.jobs, route.max_in_flight) else {
        // `check` refuses async on uncapped routes.
        charged.give_back().await;
        return Err(crate::store::Admission::Unavailable);
    };
    let job = NewJob {
        running,
        route,
        rules,
        cap,
        who,
        request,
        origin,
    };
    match (&shared.store, charged.into_held()) {
        (crate::store::Store::Memory(m), Some(charge::Held::Memory { ticket, delay })) => {
            run::submit(shared, m, job, ticket, delay).await
        }
        (
            crate::store::Store::Redis(_),
            Some(charge::Held::Redis {
                req,
                id,
                charge,
                backend,
            }),
        ) => fleet::submit(shared, &backend, job, (req, id, charge)).await,
        (store, held) => {
            // Charged on the store in use, which never changes: not reached.
            if let Some(held) = held {
                held.give_back(store).await;
            }
            Err(crate::store::Admission::Unavailable)
        }
    }
}

/// Whether a request asks to be a job: `Prefer: respond-async` (RFC 7240 §4.1; the
/// preference may share the header with others, and the header may be repeated).
pub fn prefers_async(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::HeaderName::from_static("prefer"))
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| {
            let token = p.split(';').next().unwrap_or("").trim();
            token.eq_ignore_ascii_case("respond-async")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn respond_async_is_found_among_other_preferences() {
        let mut h = http::HeaderMap::new();
        assert!(!prefers_async(&h));
        h.append("prefer", "return=minimal".parse().unwrap());
        assert!(!prefers_async(&h));
        h.append("prefer", "wait=10, Respond-Async".parse().unwrap());
        assert!(prefers_async(&h));
        let mut h = http::HeaderMap::new();
        h.append("prefer", "respond-asynchronously".parse().unwrap());
        assert!(!prefers_async(&h));
    }

    fn job(bytes: u64) -> Arc<Job> {
        Arc::new(Job {
            id: new_id(),
            key: [7; 32],
            route: Arc::from("/r"),
            status: Mutex::new(Status::Running),
            cancel: Mutex::new(None),
            refunded: tokio::sync::Notify::new(),
            bytes: AtomicU64::new(bytes),
            due: Instant::now(),
        })
    }

    #[test]
    fn the_board_bounds_the_bytes_its_jobs_hold_and_forgets_expired_results() {
        let board = Board::default();
        assert!(board.reserve(MAX_HELD_BYTES - 10));
        assert!(!board.reserve(11));
        board.unreserve(MAX_HELD_BYTES - 10);
        assert!(board.reserve(100));
        let j = job(100);
        board.insert(j.clone());
        // Another key's job is not found; its own is, while it runs.
        assert!(board.get(&j.id, &[8; 32]).is_none());
        assert!(matches!(
            board.get(&j.id, &[7; 32]),
            Some((_, View::Running { .. }))
        ));
        let kept = j.finish(
            Stored {
                status: 200,
                headers: vec![],
                body: Bytes::from_static(b"0123456789"),
            },
            Duration::ZERO,
        );
        board.resize(&j, kept);
        assert_eq!(board.held_bytes(), 10);
        // Its result has expired (a ttl of 0): gone, and its bytes with it.
        *lock(&board.last_sweep) = None;
        assert!(board.get(&j.id, &[7; 32]).is_none());
        assert_eq!(board.held_bytes(), 0);
        assert_eq!(board.counts("/r"), (0, 0));
    }

    #[test]
    fn ids_are_128_bits_of_hex_and_differ() {
        let (a, b) = (new_id(), new_id());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
