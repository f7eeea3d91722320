//! One request's state across Pingora's phases, as a state machine whose states carry only
//! what is true in them, and guards that undo what must be undone on every exit path.
//!
//! `Undecided` → `Refused` (answered by the gateway, nothing charged) | `Admitted` (charged,
//! holding slots) → `Refunded` (the upstream never answered; the charge was given back).
//! The request is finished when `logging` has run and the context drops: the drain guard, the
//! in-flight gauge and the lease release themselves then, whatever happened before.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::decision::{Classified, Reason, Refusal, Verdict};
use crate::front::ConnState;
use crate::identity::{Identity, Origin};
use crate::problem::Problem;
use crate::route::stated::Report;
use crate::route::Route;
use crate::shutdown::DrainGuard;
use crate::state::Running;
use crate::store::{AdmitRequest, Standing, Store};

pub use crate::admission::{InFlight, Ticket, UpstreamSlot};

// Lives inside the context Pingora allocates once per request, and changes state in place:
// boxing the large variant would add an allocation per admitted request.
#[allow(clippy::large_enum_variant)]
pub enum Phase {
    /// Nothing decided yet (or Pingora answered before `request_filter` ran).
    Undecided,
    /// Answered by the gateway; nothing was charged.
    Refused {
        problem: Problem,
        reason: Option<Reason>,
        outcome: Option<Standing>,
    },
    Admitted(Ticket),
    /// Charged, then given back because the upstream never produced a response.
    Refunded {
        problem: Problem,
        outcome: Standing,
    },
    /// The client went away before the request was forwarded (queued for a slot or held by
    /// `max_delay`): never forwarded, nothing charged.
    Abandoned,
    /// `mode: shadow`: the store refused (`reason`), and the request is forwarded anyway,
    /// uncharged and holding no slot; the headers describe the refusal as if enforced.
    Shadowed {
        reason: Reason,
        outcome: Option<Standing>,
    },
    /// Answered by the gateway about an async job: its submission (`outcome`: charged, the
    /// job holds the charge from now on), a submission whose body did not arrive whole
    /// (`Refunded`: no job, its charge given back), or a poll or cancel of one (free).
    Job {
        decision: Verdict,
        id: Option<Arc<str>>,
        outcome: Option<Standing>,
    },
}

pub use crate::telemetry::Timing;

/// A request's upstream leg, filled in as it is forwarded: the peer's `Host` and follow
/// horizon, the socket duplicate and body watch of an HTTP/2 request, the answer's status.
#[derive(Default)]
pub struct Leg {
    /// The `Host` of the named upstream address picked for this request (`None`: the default
    /// upstream's).
    pub host: Option<http::HeaderValue>,
    /// How long after the request was sent a late answer is still followed (the upstream's
    /// `abandon_timeout`).
    pub abandon_after: Duration,
    /// The upstream's `read_timeout`, and whether it is reached over TLS (a late answer read
    /// from the socket's duplicate is then ciphertext: nothing to settle on).
    pub read_timeout: Duration,
    pub tls: bool,
    /// A duplicate of the upstream socket, for an HTTP/2 request on a capped route: if the
    /// client resets the stream, the upstream's answer is drained from it so that the slot
    /// follows the upstream's work.
    pub dup: Option<std::os::fd::OwnedFd>,
    /// `server.body_timeout` for an HTTP/2 request body being forwarded (Pingora times only
    /// HTTP/1 bodies).
    pub body_watch: Option<crate::front::BodyWatch>,
    /// The status the upstream answered with (before the gateway's own headers).
    pub status: Option<u16>,
    /// Whether the upstream had the request when the attempt on this connection failed
    /// (`upstreams::had_request`), decided once, when it failed: it may be sent again then.
    pub had_request: Option<bool>,
    /// The request's body has ended (or it has none): the upstream has the whole request to
    /// work on. Kept here because an HTTP/2 session whose connection closed no longer says
    /// its body was done.
    pub whole_request: bool,
    /// The upstream failed and the gateway answered for it with the whole request read: the
    /// client's HTTP/1 connection goes on after the answer (`front::keep_after_failure`).
    pub keep_client: bool,
    /// The addresses of a named pool that refused this request's connection (it never
    /// reached them): its next attempt goes to another (`Pool::pick`).
    pub refused_by: Vec<std::net::SocketAddr>,
}

/// One request, from the first phase Pingora runs to `logging`: its phase, the facts every
/// phase reads, and the upstream leg.
pub struct Ctx {
    pub start: Instant,
    /// Counts the request in flight for the drain, and keeps a duplicate of its upstream
    /// socket (`DrainGuard::follow_socket`): should the upstream close it unanswered, its TCP
    /// state says whether it read the request (`upstreams::read_before_closing`), and an exit
    /// past the grace period shuts it down to cut the request off (`Drain::cut_off`).
    pub drain: DrainGuard,
    /// The client connection's front-door state (absent for streams that didn't come through
    /// it).
    pub conn: Option<Arc<ConnState>>,
    /// Turn the client shield on once the request body has been read in full (capped routes).
    pub shield_after_body: bool,
    /// A held (`max_delay`) request given back as its instance exits: its permit
    /// (`Shared::holds`) kept until it has been answered, for the exit to wait for.
    pub given_back: Option<tokio::sync::OwnedSemaphorePermit>,
    /// A capped route's request answered because the instance exits while it waited for its
    /// slot (or its turn): counted until it has been answered, for the exit to wait for.
    pub leaving: Option<crate::shutdown::Waiting>,
    /// The config this request runs under, from its first phase to its last.
    pub running: Option<Arc<Running>>,
    pub route: Option<Arc<Route>>,
    /// What the upstream receives instead of the client's method / target, if anything.
    pub forward: Option<Classified>,
    pub identity: Option<Identity>,
    /// The peer and the client address (`identity.trusted_proxies`).
    pub origin: Option<Origin>,
    pub phase: Phase,
    /// The upstream leg: where the request went and what came back.
    pub upstream: Leg,
    pub timing: Timing,
    /// The client's `X-Request-Id`, or one made up for it; sent upstream and logged.
    pub request_id: Option<String>,
    /// The decision was made by `store.on_error`, not by the shared store.
    pub fallback: bool,
    /// The request's final charge once settled after the response (`cost_per_second`,
    /// `cost_from_response`); `None` before, or when nothing was charged.
    pub settled: Option<u64>,
    /// Its settling follows the upstream's late answer (a client gone before it: `LateSettle`):
    /// its units and stated cost are counted then, not at `logging`.
    pub settles_late: bool,
    /// What the upstream's response said the request cost (`cost_from_response` routes,
    /// charged requests).
    pub report: Option<Report>,
    /// The decision's figures are of `1/share` of each budget (`store::Decision::share`).
    pub share: u32,
    /// Classified and identified, and to become an async job (DESIGN §8): what to charge.
    pub job: Option<AdmitRequest>,
    /// The request's spans, when `tracing:` is on (`None` otherwise: nothing is built).
    pub trace: Option<Box<crate::trace::RequestTrace>>,
}

impl Ctx {
    pub fn new(drain: DrainGuard) -> Ctx {
        Ctx {
            start: Instant::now(),
            drain,
            conn: None,
            shield_after_body: false,
            given_back: None,
            leaving: None,
            running: None,
            route: None,
            forward: None,
            identity: None,
            origin: None,
            phase: Phase::Undecided,
            upstream: Leg::default(),
            timing: Timing::default(),
            request_id: None,
            fallback: false,
            settled: None,
            settles_late: false,
            report: None,
            share: 1,
            job: None,
            trace: None,
        }
    }

    /// Records a refusal (nothing charged).
    pub fn refuse(&mut self, r: &Refusal) {
        self.timing.queued = r.queued;
        self.phase = Phase::Refused {
            problem: r.problem,
            reason: r.reason,
            outcome: r.outcome,
        };
    }

    /// Records an admission (its ticket counting in flight on its route), after `queued`
    /// waiting for a slot.
    pub fn admit(&mut self, ticket: Ticket, queued: Duration) {
        self.timing.queued = queued;
        self.phase = Phase::Admitted(ticket);
    }

    /// Gives the charge back and frees the slots at once: the upstream never ran it.
    pub async fn refund(&mut self, store: &Store, problem: Problem) {
        let phase = std::mem::replace(&mut self.phase, Phase::Undecided);
        self.phase = match phase {
            Phase::Admitted(mut ticket) => Phase::Refunded {
                problem,
                outcome: ticket.refund(store).await,
            },
            other => other,
        };
    }

    /// The client left before the request was forwarded: give back whatever was charged and
    /// free the slots.
    pub async fn abandon(&mut self, store: &Store) {
        if let Phase::Admitted(mut ticket) = std::mem::replace(&mut self.phase, Phase::Abandoned) {
            ticket.refund(store).await;
        }
    }

    /// Frees the slots now (dropping the context would too, without waiting).
    pub async fn release(&mut self) {
        if let Phase::Admitted(ticket) = &mut self.phase {
            ticket.release().await;
        }
    }

    /// Takes the slots out of an admitted request (which stays admitted and charged), for a
    /// release that waits for the upstream.
    pub fn detach_slot(&mut self) -> Option<UpstreamSlot> {
        match &mut self.phase {
            Phase::Admitted(ticket) => Some(ticket.detach_for_upstream()),
            _ => None,
        }
    }

    /// Records a refusal that shadow mode forwards instead (nothing charged, no slot).
    pub fn shadow(&mut self, r: &Refusal, reason: Reason) {
        self.timing.queued = r.queued;
        self.phase = Phase::Shadowed {
            reason,
            outcome: r.outcome,
        };
    }

    /// Once the upstream has answered: makes the request's final charge what the upstream
    /// stated (`cost_from_response`), else what its route bills for measured time
    /// (`cost_per_second`), charging (even into debt) or refunding the difference where the
    /// admission was charged. Once: a stated cost settles before its answer goes on to the
    /// client, everything else when the request ends.
    pub async fn settle(&mut self, store: &Store) {
        let (Phase::Admitted(c), Some(route), None) = (&self.phase, &self.route, self.settled)
        else {
            return;
        };
        // Without a response (the client left first) the upstream worked at least until now.
        let upstream = self
            .timing
            .upstream
            .or_else(|| self.timing.upstream_start.map(|s| s.elapsed()));
        let total = route.fidelity.charge(c.req.cost, upstream, self.report);
        c.settle(store, total).await;
        self.settled = Some(total);
    }

    /// The budget decision to describe in the rate-limit headers, if there was one.
    pub fn outcome(&self) -> Option<&Standing> {
        match &self.phase {
            Phase::Refused { outcome, .. } | Phase::Shadowed { outcome, .. } => outcome.as_ref(),
            Phase::Admitted(c) => Some(&c.outcome),
            Phase::Refunded { outcome, .. } => Some(outcome),
            Phase::Job { outcome, .. } => outcome.as_ref(),
            Phase::Undecided | Phase::Abandoned => None,
        }
    }

    /// What this request has been charged (`X-RateLimit-Cost`, the access log, the counter).
    pub fn charged(&self) -> u64 {
        match (&self.phase, &self.route) {
            (Phase::Admitted(_), Some(r)) => r.cost,
            (
                Phase::Job {
                    decision: Verdict::JobSubmitted,
                    outcome: Some(_),
                    ..
                },
                Some(r),
            ) => r.cost,
            _ => 0,
        }
    }

    /// The request's whole charge: the admission's, or what it was settled to after the
    /// response (the access log's `cost`, `tollgate_cost_units_total`).
    pub fn final_charge(&self) -> u64 {
        match (&self.phase, self.settled) {
            (Phase::Admitted(_), Some(total)) => total,
            _ => self.charged(),
        }
    }

    pub fn is_admitted(&self) -> bool {
        matches!(self.phase, Phase::Admitted(_))
    }

    /// A job submitted (answered 202 with the figures of its charge).
    pub fn job_submitted(&self) -> bool {
        matches!(
            self.phase,
            Phase::Job {
                decision: Verdict::JobSubmitted,
                ..
            }
        )
    }

    /// Admitted at some point (and so forwarded, or about to be): the requests whose latency
    /// is the gateway's service level, as opposed to its refusals.
    pub fn was_forwarded(&self) -> bool {
        matches!(
            self.phase,
            Phase::Admitted(_) | Phase::Refunded { .. } | Phase::Shadowed { .. }
        )
    }

    /// The time the gateway itself added: all of it but the upstream's part and the waiting.
    /// From sending the request on, the answer is passed on as it comes, at the upstream's and
    /// the client's pace (the upstream's histogram counts up to its head; the streamed body is
    /// in the request's duration only): so the gateway's own time is what came before. Never
    /// sent (a refunded 502, a 408): all of `elapsed`, the request's whole time as measured
    /// for `tollgate_request_duration_seconds`, which it never exceeds.
    pub fn overhead(&self, elapsed: Duration) -> Duration {
        let before = match self.timing.upstream_start {
            Some(sent) => sent.saturating_duration_since(self.start).min(elapsed),
            None => elapsed,
        };
        before
            .saturating_sub(self.timing.queued)
            .saturating_sub(self.timing.hold)
    }

    /// What shadow mode let through: the reason enforcement would have refused.
    pub fn shadow_reason(&self) -> Option<Reason> {
        match self.phase {
            Phase::Shadowed { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// The access log's `decision`.
    pub fn decision(&self) -> Verdict {
        match self.phase {
            Phase::Refused {
                reason: Some(reason),
                ..
            } => Verdict::Refused(reason),
            Phase::Refused { reason: None, .. } | Phase::Undecided => Verdict::Error,
            Phase::Admitted(_) => Verdict::Admitted,
            Phase::Refunded { .. } => Verdict::Refunded,
            Phase::Abandoned => Verdict::ClientGone,
            Phase::Shadowed { .. } => Verdict::Shadow,
            Phase::Job { decision, .. } => decision,
        }
    }

    /// The async job this request submitted or asked about.
    pub fn job_id(&self) -> Option<&str> {
        match &self.phase {
            Phase::Job { id, .. } => id.as_deref(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::IntGauge;

    use super::*;
    use crate::budget::Limit;
    use crate::shutdown::Drain;
    use crate::store::{Lease, MemoryStore};

    fn outcome() -> Standing {
        Standing {
            remaining: 7,
            reset_us: 0,
            each: Default::default(),
        }
    }

    fn req() -> AdmitRequest {
        AdmitRequest {
            key: [1; 32],
            limit: Limit::new(10, Duration::from_secs(10), Duration::ZERO).unwrap(),
            also: vec![],
            cost: 3,
            key_cap: None,
            route: Arc::from("/r"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        }
    }

    #[tokio::test]
    async fn guards_count_out_on_drop_and_refund_moves_on() {
        let drain = Drain::new();
        let gauge = IntGauge::new("t_in_flight", "test").unwrap();
        let store = Store::Memory(MemoryStore::new(crate::store::memory::Clock::new(0)));
        let mut ctx = Ctx::new(drain.enter());
        assert_eq!((drain.active(), ctx.decision().as_str()), (1, "error"));
        let ticket = Ticket::new(req(), outcome(), Lease::default()).in_flight(&gauge);
        ctx.admit(ticket, Duration::ZERO);
        assert_eq!((gauge.get(), ctx.decision().as_str()), (1, "admitted"));
        assert!(ctx.is_admitted());
        ctx.refund(&store, Problem::BadGateway).await;
        assert_eq!(
            (gauge.get(), ctx.decision().as_str(), ctx.charged()),
            (0, "refunded", 0)
        );
        assert_eq!(ctx.outcome().map(|o| o.remaining), Some(7));
        drop(ctx);
        assert_eq!(drain.active(), 0);
    }

    #[test]
    fn refusals_say_why() {
        let drain = Drain::new();
        let mut ctx = Ctx::new(drain.enter());
        let r = crate::decision::upstream_failed(crate::decision::UpstreamFailure::TimedOut);
        ctx.refuse(&r);
        assert_eq!(ctx.decision().as_str(), "error");
        ctx.refuse(&Refusal {
            reason: Some(Reason::Budget),
            ..r
        });
        assert_eq!((ctx.decision().as_str(), ctx.charged()), ("budget", 0));
    }
}
